"""The built-model half of the contract, in a process of its own: `python -m mimo.testing.worker`.

It builds the provider's model through mimo's own machinery (the plan, and the world as `mimo run` joins it: a
world of one on gloo with the CPU redirect, grids, seeds, model; then the optimizer and `TrainStep`), checks each
image's placeholder count against its encoder's output, trains a few iterations, and round-trips the model through megatron-core's dist_checkpointing. The CPU redirect
and the process group last for the life of a process, so the caller's process stays untouched. It prints one
line, `RESULT_MARK` + JSON: {"ok": true, ...numbers} or {"ok": false, "error": "hook: rule"}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
import warnings
from pathlib import Path

RESULT_MARK = "MIMO_CONTRACT_RESULT "
ITERATIONS = 2
MICRO_BATCH_SIZE = 2
NUM_MICROBATCHES = 2
SEED = 1234


class Stage:
    """Which hook or part the worker is exercising, so an unexpected exception is blamed on it."""

    current = "worker"


def run(name: str, assignments: list[str], workdir: Path) -> dict:
    import torch

    from mimo.core.config import RunConfig, TrainingOptions
    from mimo.core.parallel import topology
    from mimo.core.parallel.model import count_parameters, held_modules
    from mimo.core.parallel.optim import build_optimizer, build_scheduler
    from mimo.core.run.plan import prepare
    from mimo.core.run.step import TrainStep
    from mimo.core.run.world import join
    from mimo.errors import UsageError
    from mimo.plugins import LANGUAGE, DataContext, Registry
    from mimo.plugins.data_source import as_data_source

    from .memory_check import built_parameter_mismatch
    from .report import ContractError

    called: set[str] = set()
    registry = Registry()
    registry.manager.add_hookcall_monitoring(lambda hook, impls, kwargs: called.add(hook),
                                             lambda outcome, hook, impls, kwargs: None)
    Stage.current = "model_shape"
    config = RunConfig(provider=name, provider_settings=list(assignments), training=TrainingOptions(
        micro_batch_size=MICRO_BATCH_SIZE, num_microbatches=NUM_MICROBATCHES, train_iters=ITERATIONS,
        device="cpu", seed=SEED))
    try:
        plan = prepare(config, registry, world_size=1)
    except UsageError as err:
        raise ContractError("model_shape", f"mimo refuses the provider's layout for one CPU rank: {err}") from None
    Stage.current = "setup"  # mimo's world of one and grids: nothing of the provider's runs here
    world = join(plan)  # as `mimo run` starts: a world of one on gloo, the grids, the seeds, the BuildContext

    def build(seed: int):
        Stage.current = "build_encoders/build_language_model"  # megatron-core builds the MimoModel from both
        try:
            return world.build_model(seed)
        except UsageError as err:  # mimo's own checks name the hook: "provider 'x': build_encoders returned ..."
            hook, _, rule = str(err).removeprefix(f"provider '{name}': ").partition(" ")
            raise ContractError(hook, rule) from None

    model = build(SEED)
    built = count_parameters(model)
    mismatch = built_parameter_mismatch(plan.hooks.module_memory(settings=plan.settings), built)
    if mismatch:
        raise ContractError("module_memory", mismatch)
    for module, shape in plan.shapes.items():
        if shape.num_parameters is not None and shape.num_parameters != built[module]:
            raise ContractError("model_shape", f"declared {shape.num_parameters:,} parameters for '{module}' but the "
                                               f"built module has {built[module]:,}")

    Stage.current = "data_provider"
    first, count = topology.data_positions(plan.parallelism, 0, MICRO_BATCH_SIZE)
    source = as_data_source(plan.hooks.data_provider(settings=plan.settings, ctx=DataContext(
        micro_batch_size=MICRO_BATCH_SIZE, num_microbatches=NUM_MICROBATCHES, num_lanes=plan.num_lanes, seed=SEED,
        first_position=first, num_positions=count)), name)
    batches = [next(source) for _ in range(ITERATIONS * NUM_MICROBATCHES)]
    source.close()
    encoders_fed, notes = set(), set()
    for m, batch in enumerate(batches):
        encoders_fed |= check_encoder_outputs(model, batch, plan.shapes[LANGUAGE].hidden_size, m, notes)
    Stage.current = "concat_encoder_inputs"
    check_concat_encoder_inputs(plan.hooks, plan.settings, model, batches, notes)

    Stage.current = "forward_backward"  # forward, the loss hook, backward and the optimizer step
    optimizer = build_optimizer(config.optimizer, model=model, params_dtype=torch.float32)
    scheduler = build_scheduler(config.scheduler, optimizer=optimizer, optimizer_options=config.optimizer,
                                global_batch_size=plan.global_batch_size,
                                train_samples=plan.train_iters * plan.global_batch_size)
    step = TrainStep(config.training, world=world, model=model, optimizer=optimizer, scheduler=scheduler,
                     seq_length=batches[0]["input_ids"].shape[1])
    model.train()
    data = iter(batches)
    results = [step(data) for _ in range(ITERATIONS)]
    trainable = {module: any(p.requires_grad for p in m.parameters()) for module, m in held_modules(model)}
    check_training(results, trainable, encoders_fed)

    Stage.current = "checkpoint"
    check_checkpoint(model, build, batches[0], workdir)
    Stage.current = "hf_settings/hf_tensor_map/hf_export"
    check_hf_conversion(plan.hooks, plan.settings, model, build, notes)
    Stage.current = "load_pretrained"
    check_foreign_checkpoint(plan.hooks, plan.settings, model, workdir)
    Stage.current = "prompt_format"  # the prompt rendered, then decoded incrementally and by recomputation
    from .generation_check import check_generation

    notes |= {note} if (note := check_generation(plan.hooks, plan.settings, world, model)) else set()
    return {"built_parameters": built, "losses": [r.lm_loss for r in results],
            "seq_length": int(batches[0]["input_ids"].shape[1]), "hooks_called": sorted(called),
            "notes": sorted(notes)}


def check_encoder_outputs(model, batch: dict, language_hidden: int, m: int, notes: set[str]) -> set[str]:
    """Each modality's encoder yields one embedding per placeholder token, in the language model's hidden size,
    and each sample's placeholders match the embeddings of its own images (taken in order). Returns the
    modalities this micro-batch feeds; adds to `notes` what could not be checked."""
    import torch

    from .report import ContractError

    inputs = batch.get("modality_inputs") or {}
    for modality, encoder_inputs in inputs.items():
        token = model.special_token_ids[modality]
        module = model.modality_submodules[modality]
        with torch.no_grad():
            output = module(encoder_inputs=encoder_inputs)
        if not isinstance(output, torch.Tensor) or output.dim() != 2:
            raise ContractError("build_encoders", f"the '{modality}' module must return [tokens, hidden] embeddings, "
                                                  f"got {getattr(output, 'shape', type(output).__name__)}")
        if output.shape[1] != language_hidden:
            raise ContractError("build_encoders", f"the '{modality}' module yields embeddings of size {output.shape[1]}"
                                                  f" but the language model's hidden size is {language_hidden}")
        per_sample = (batch["input_ids"] == token).sum(dim=1).tolist()
        if sum(per_sample) != output.shape[0]:
            raise ContractError("data_provider", f"micro-batch {m} has {sum(per_sample)} '{modality}' placeholder "
                                                 f"tokens (id {token}) but its images give {output.shape[0]} "
                                                 f"embeddings")
        per_image = _tokens_per_image(module, encoder_inputs)
        if per_image is None:
            notes.add(f"per-image placeholder counts of '{modality}' not checked: its inputs do not split into "
                      f"images along one leading dimension (the micro-batch's total was checked)")
            continue
        image = 0
        for sample, count in enumerate(per_sample):
            first, given = image, 0
            while given < count and image < len(per_image):
                given, image = given + per_image[image], image + 1
            if given != count:
                raise ContractError("data_provider", f"sample {sample} of micro-batch {m} has {count} '{modality}' "
                                                     f"placeholder tokens but its images give {given} embeddings "
                                                     f"({per_image[first:image]} per image, in order)")
    return set(inputs)


def check_concat_encoder_inputs(hooks, settings, model, batches: list[dict], notes: set[str]) -> None:
    """`concat_encoder_inputs` (optional): each modality's encoders give, for the micro-batches' inputs joined,
    exactly their outputs for each micro-batch one after another (what `--encoder-pass step` relies on)."""
    import torch

    from .report import ContractError

    if not hooks.concat_encoder_inputs.get_hookimpls():
        notes.add("concat_encoder_inputs not implemented: the encoders run once per micro-batch")
        return
    for modality, module in model.modality_submodules.items():
        inputs = [b["modality_inputs"][modality] for b in batches if (b.get("modality_inputs") or {}).get(modality)]
        if len(inputs) < 2:
            continue
        joined = hooks.concat_encoder_inputs(settings=settings, modality=modality, inputs=inputs)
        if joined is None:
            continue
        with torch.no_grad():
            expected = torch.cat([module(encoder_inputs=i) for i in inputs])
            got = module(encoder_inputs=joined)
        if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
            raise ContractError("concat_encoder_inputs", f"the '{modality}' encoders give {tuple(got.shape)} for "
                                                         f"the joined inputs of {len(inputs)} micro-batches, not their "
                                                         f"outputs one after another {tuple(expected.shape)}")


def _tokens_per_image(module, encoder_inputs: dict) -> list[int] | None:
    """Run the modality's module on one image at a time, if its inputs split so: the leading size all its
    tensors share is the image count. None when they do not split, or a single image does not run."""
    import torch

    sizes = {v.shape[0] for args in encoder_inputs.values() for v in args.values()
             if isinstance(v, torch.Tensor) and v.dim()}
    if len(sizes) != 1:
        return None
    counts = []
    for i in range(sizes.pop()):
        one = {name: {k: v[i:i + 1] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in args.items()}
               for name, args in encoder_inputs.items()}
        try:
            with torch.no_grad():
                counts.append(module(encoder_inputs=one).shape[0])
        except Exception:  # noqa: BLE001 - an encoder that needs its images together: leave it to the total
            return None
    return counts


def check_training(results, trainable: dict[str, bool], encoders_fed: set[str]) -> None:
    from mimo.plugins import LANGUAGE

    from .report import ContractError

    for i, r in enumerate(results, 1):
        if not math.isfinite(r.lm_loss) or r.num_tokens <= 0:
            raise ContractError("loss", f"iteration {i}: loss {r.lm_loss} over {r.num_tokens} tokens; a finite loss "
                                        f"over at least one token is needed")
        if r.grad_norm is None or not math.isfinite(r.grad_norm) or r.grad_norm <= 0:
            raise ContractError("loss", f"iteration {i}: gradient norm {r.grad_norm}; backward reached no parameter")
        for module, is_trainable in trainable.items():
            fed = module == LANGUAGE or module in encoders_fed
            if is_trainable and fed and not r.module_grad_norms.get(module, 0.0) > 0:
                hook = "build_language_model" if module == LANGUAGE else "build_encoders"
                raise ContractError(hook, f"iteration {i}: module '{module}' got no gradient (its output does not "
                                          f"reach the loss)")


HF_PROBE = {"model_type": "mimo-contract-probe"}  # a Hugging Face model type no provider reads


def check_hf_conversion(hooks, settings, model, build, notes: set[str]) -> None:
    """The Hugging Face hooks: None for a model type the provider does not read; the trained model exported
    through `hf_export`'s map reads back (`hf_settings`) as the same settings and loads back through
    `hf_tensor_map` into a freshly built model with every bit. Settings the provider cannot export
    (`hf_export_check`) must be refused by `hf_export` too (one line), and are noted, not checked further."""
    import torch

    from mimo.core.checkpoint.hf import plain_value
    from mimo.core.checkpoint.hf_load import global_tensors, load_into
    from mimo.errors import UsageError
    from mimo.plugins.kit.safetensors_io import TensorsSource
    from mimo.plugins.kit.tensor_map import HFExport, to_hf

    from .report import ContractError

    for part in ("model", "language", "vision"):
        if hooks.hf_settings(hf_config=dict(HF_PROBE), part=part) is not None:
            raise ContractError("hf_settings", f"must return None for a model type the provider does not read "
                                               f"({HF_PROBE['model_type']!r}, part {part!r})")
        if hooks.hf_tensor_map(settings=settings, hf_config=dict(HF_PROBE), part=part) is not None:
            raise ContractError("hf_tensor_map", f"must return None for a model type the provider does not read "
                                                 f"({HF_PROBE['model_type']!r}, part {part!r})")
    refused = hooks.hf_export_check(settings=settings)
    if refused is None:
        return
    if refused:
        try:
            hooks.hf_export(settings=settings)
        except UsageError as err:
            if "\n" in str(err):
                raise ContractError("hf_export", "a refusal must be one line") from None
        else:
            raise ContractError("hf_export", "must refuse (UsageError) the settings hf_export_check refuses")
        notes.add(f"Hugging Face export not checked: these settings have no Hugging Face form "
                  f"({', '.join(f'{k}={v[0]!r}' for k, v in refused.items())})")
        return
    try:
        export = hooks.hf_export(settings=settings)
    except UsageError as err:
        raise ContractError("hf_export", f"refuses settings hf_export_check accepts ({err})") from None
    if not isinstance(export, HFExport):
        raise ContractError("hf_export", f"must return a mimo.plugins.kit.tensor_map.HFExport, got "
                                         f"{type(export).__name__}")
    fields = hooks.hf_settings(hf_config=export.config, part="model")
    if not isinstance(fields, dict):
        raise ContractError("hf_settings", "must read the config.json that hf_export writes (got None)")
    for name, value in fields.items():
        have = getattr(settings, name, None)  # None: a setting left to resolve itself (may be read back resolved)
        if have is not None and plain_value(have) != plain_value(value) and not export.notes:
            raise ContractError("hf_settings", f"reads {name}={value!r} from hf_export's config.json, the model "
                                               f"it came from has {have!r} (and hf_export's notes say nothing)")
    trained = global_tensors(model)
    try:
        tensors = to_hf(export.tensors, trained)
    except KeyError as err:
        raise ContractError("hf_export", f"its map names {err}, which the model does not save") from None
    tmap = hooks.hf_tensor_map(settings=settings, hf_config=export.config, part="model")
    if tmap is None:
        raise ContractError("hf_tensor_map", "must map the config.json that hf_export writes (got None)")
    fresh = build(SEED + 2)
    _, initial, errors = load_into(fresh, [(tmap, TensorsSource(tensors))])
    if errors or initial:
        raise ContractError("hf_tensor_map", f"loading hf_export's tensors back: {(errors or initial)[0]}")
    back = global_tensors(fresh)
    changed = [k for k, t in trained.items() if not torch.equal(back[k], t)]
    if changed:
        raise ContractError("hf_tensor_map", f"hf_export then hf_tensor_map changes {changed[0]}: the round trip "
                                             f"must keep every bit")


def check_checkpoint(model, build, batch: dict, workdir: Path) -> None:
    """`model.sharded_state_dict()` saved with dist_checkpointing loads into a freshly built model (other seed)
    and restores every tensor and the forward pass."""
    import torch
    from megatron.core import dist_checkpointing

    from .report import ContractError

    directory = workdir / "checkpoint"
    directory.mkdir(parents=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(directory))
    fresh = build(SEED + 1)
    saved, before = _tensors(model), _tensors(fresh)
    if all(k in before and torch.equal(v, before[k]) for k, v in saved.items()):
        raise ContractError("checkpoint", "a model built with another seed equals the trained one: the round trip "
                                          "cannot be told from no load at all")
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(directory)), strict=False)
    after = _tensors(fresh)
    for key, value in saved.items():
        if key not in after or not torch.equal(value, after[key]):
            raise ContractError("checkpoint", f"'{key}' differs after a save and load through dist_checkpointing "
                                              f"(is it missing from its module's sharded_state_dict?)")
    model.eval(), fresh.eval()
    inputs = {k: v for k, v in batch.items() if k != "modality_inputs"}
    with torch.no_grad():
        a, _ = model(**inputs, modality_inputs=batch["modality_inputs"] or None)
        b, _ = fresh(**inputs, modality_inputs=batch["modality_inputs"] or None)
    if not torch.equal(a, b):
        raise ContractError("checkpoint", "the loaded model's forward differs from the saved model's: some state "
                                          "outside the state dict (a buffer, a non-persistent tensor) changes it")


def _tensors(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if hasattr(v, "dtype")}


def _quiet() -> None:
    """megatron-core announces missing optional kernels on import; the worker's caller reads one line."""
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)


def check_foreign_checkpoint(hooks, settings, model, workdir) -> None:
    """`load_pretrained` returns None for a dist checkpoint that is not in the provider's format (one tensor under
    a name no model has): mimo then says no provider reads it."""
    import torch
    import torch.distributed.checkpoint as dcp

    from .report import ContractError

    directory = Path(workdir) / "foreign-checkpoint"
    dcp.save({"not_a_model.probe": torch.zeros(2)}, checkpoint_id=str(directory), no_dist=True)
    if hooks.load_pretrained(settings=settings, model=model, directory=directory) is not None:
        raise ContractError("load_pretrained", "must return None for a checkpoint not in the provider's format")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mimo.testing.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--provider", required=True)
    parser.add_argument("--set", action="append", default=[], dest="assignments")
    parser.add_argument("--workdir", required=True, type=Path)
    args = parser.parse_args(argv)
    _quiet()
    from .report import ContractError

    try:
        result = {"ok": True, **run(args.provider, args.assignments, args.workdir)}
    except ContractError as err:
        result = {"ok": False, "error": str(err)}
    except Exception as err:  # noqa: BLE001 - any failure is reported as the hook being exercised
        where = traceback.extract_tb(err.__traceback__)[-1]
        result = {"ok": False, "error": f"{Stage.current}: {type(err).__name__}: {err} "
                                        f"(at {Path(where.filename).name}:{where.lineno})"}
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":  # dist_checkpointing's save may start helper processes, which re-import this module
    sys.exit(main())

