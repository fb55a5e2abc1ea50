"""Hugging Face model folders <-> mimo checkpoints, in one process (a world of one, TP1, the whole model).

The provider converts names and tensors (hooks `hf_settings`, `hf_to_mimo`, `mimo_to_hf`); this module builds the
model through mimo's own machinery, loads the converted weights strictly, and reads or writes checkpoints with
`Checkpointer` (Megatron dist-ckpt), so a converted checkpoint loads into any layout and any layout exports.

    import_hf(HF_DIR, OUT)          OUT: a weights-only mimo checkpoint + OUT/provider.yaml (provider and settings)
    export_hf(CKPT, OUT)            OUT: config.json + safetensors that `from_pretrained` loads
    pretrained_from_hf(plan)        `mimo run --pretrained HF_DIR`: converted to a temporary checkpoint first
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import shutil
import tempfile
from pathlib import Path

import torch
import yaml

from mimo.errors import UsageError
from mimo.plugins import Registry, module_prefix
from mimo.plugins.kit import safetensors_io

from ..config import CheckpointOptions, RunConfig, TrainingOptions
from ..run.plan import prepare
from ..run.world import World, join
from . import atomic_dir
from .checkpointer import Checkpointer
from .foreign import foreign_directory
from .layout import PRETRAINED_SOURCE_ENV, TRACKER, iteration_dir, read_common, read_tracker, run_info

SETTINGS_FILE = "provider.yaml"
# Set by `mimo run` for its workers: the temporary mimo checkpoint converted from `--pretrained HF_DIR`.
CONVERTED_ENV = "MIMO_PRETRAINED_CONVERTED"


def is_hf_folder(path: Path | None) -> bool:
    path = Path(path) if path else None
    return bool(path) and (path / safetensors_io.CONFIG_FILE).is_file() and (
        (path / safetensors_io.SINGLE_FILE).is_file() or (path / safetensors_io.INDEX_FILE).is_file())


# ------------------------------------------------------------------------------------------------- providers


def find_provider(registry: Registry, hf_config: dict, name: str | None = None) -> tuple[str, dict]:
    """(provider name, settings) for a config.json: the named provider's, or that of the one plugin whose
    `hf_settings` reads it (the variant whose defaults agree with the most settings)."""
    model_type = hf_config.get("model_type")
    if name is not None:
        fields = registry.hooks(name).hf_settings(hf_config=hf_config)
        if fields is None:
            raise UsageError(f"provider '{name}' does not read Hugging Face model_type {model_type!r}")
        return name, fields
    readers = []
    for plugin in registry.plugins:
        if plugin.providers:
            fields = registry.hooks(plugin.providers[0].name).hf_settings(hf_config=hf_config)
            if fields is not None:
                readers.append((plugin, fields))
    if not readers:
        raise UsageError(f"no installed provider reads Hugging Face model_type {model_type!r} (see: mimo "
                         f"providers list)")
    if len(readers) > 1:
        names = " and ".join(f"'{p.providers[0].name}' ({p.distribution})" for p, _ in readers)
        raise UsageError(f"providers {names} both read model_type {model_type!r}: choose one with --provider")
    plugin, fields = readers[0]
    return _closest_variant(plugin.providers, fields).name, fields


def _closest_variant(providers, fields: dict):
    """Among the variants whose defaults together with `fields` are valid settings (a checkpoint's small RADIO
    position grid cannot hold a large variant's patch counts), the one agreeing with the most fields."""
    def agreement(provider):
        defaults = provider.settings(**provider.defaults)
        return sum(plain_value(getattr(defaults, k, None)) == plain_value(v) for k, v in fields.items())

    valid, first_error = [], None
    for provider in providers:
        try:
            provider.settings(**{**provider.defaults, **fields})
            valid.append(provider)
        except (TypeError, ValueError, UsageError) as err:
            first_error = first_error or f"{provider.name}: {err}"
    if not valid:
        raise UsageError(f"no variant holds the checkpoint's settings ({first_error})")
    return max(valid, key=agreement)  # the first registered among equals


def plain_value(value):
    """A setting as YAML and config.json hold it (tuples as lists), for comparing values from either."""
    return list(value) if isinstance(value, tuple) else value


def write_settings(path: Path, provider: str, fields: dict) -> None:
    """A `--provider-config` file: `provider:` and the settings."""
    values = {"provider": provider, **{k: plain_value(v) for k, v in fields.items()}}
    path.write_text(yaml.safe_dump(values, sort_keys=False))


# ---------------------------------------------------------------------------------------------- one process


def _build(registry: Registry, provider: str, settings_file: Path | None, assignments: list[str],
           precision: str, device: str) -> tuple[World, object]:
    """The whole model in a world of one (TP1), built as `mimo run` builds it (seeded with 0)."""
    config = RunConfig(provider=provider, provider_settings=list(assignments), provider_config=settings_file,
                       training=TrainingOptions(micro_batch_size=1, train_iters=1, precision=precision, device=device))
    world = join(prepare(config, registry, world_size=1), seed=0)
    return world, world.build_model()


def _checkpointer(world: World, model, options: CheckpointOptions) -> Checkpointer:
    info = run_info(world.plan, world.plan.settings, lane_data_state=False)
    return Checkpointer(options, model=model, topology=world.topology, run_info=info,
                        data_state=lambda: {"loader": None})


def whole_state(model) -> dict[str, torch.Tensor]:
    from ..parallel.model import held_modules

    return {module_prefix(name) + key: t for name, wrapped in held_modules(model)
            for key, t in wrapped.module.state_dict().items()}


def _load_whole_state(model, state: dict[str, torch.Tensor], source: Path) -> None:
    """Every weight of the model from `state` (MimoModel names), nothing left over: else one line."""
    from ..parallel.model import held_modules

    missing, used = [], set()
    for name, wrapped in held_modules(model):
        prefix = module_prefix(name)
        part = {k[len(prefix):]: t for k, t in state.items() if k.startswith(prefix)}
        used |= {prefix + k for k in part}
        result = wrapped.module.load_state_dict(part, strict=False)
        missing += [prefix + k for k in result.missing_keys if not k.endswith("_extra_state")]
        used -= {prefix + k for k in result.unexpected_keys}
    if missing:
        raise UsageError(f"{source} lacks {len(missing)} weights the model needs, e.g. {', '.join(missing[:3])}")
    if unexpected := sorted(set(state) - used):
        raise UsageError(f"{source} converts to {len(unexpected)} weights the model has no place for, e.g. "
                         f"{', '.join(unexpected[:3])}")


def _finish_world() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _precision(hf_config: dict) -> str:
    dtype = hf_config.get("dtype") or hf_config.get("torch_dtype") or (hf_config.get("text_config") or {}).get("dtype")
    return "bf16" if dtype == "bfloat16" else "fp32"


# ------------------------------------------------------------------------------------------------ conversions


def import_hf(hf_dir: Path, out: Path, provider: str | None = None, registry: Registry | None = None,
              device: str = "cpu") -> str:
    """Convert a Hugging Face folder into a weights-only mimo checkpoint in `out` and `out/provider.yaml`.
    Returns the provider's name."""
    safetensors_io.library()  # the hf extra, before any work
    registry = registry or Registry()
    hf_config = safetensors_io.read_config(hf_dir)
    provider, fields = find_provider(registry, hf_config, provider)
    # written into a partial folder renamed to OUT at the end: a killed import leaves no OUT to trip on
    with atomic_dir.writing(Path(out), what="import", unfinished=unfinished_import) as folder:
        write_settings(folder / SETTINGS_FILE, provider, fields)
        _convert_into(registry, provider, folder / SETTINGS_FILE, [], hf_dir, hf_config, folder, device)
    return provider


def unfinished_import(out: Path) -> str | None:
    """Why `out` looks like an import an older mimo left unfinished in place (provider.yaml, no tracker), or None."""
    names = {p.name for p in out.iterdir()}
    if SETTINGS_FILE in names and TRACKER not in names and names <= {SETTINGS_FILE, "iter_0000000", ".mimo-lock"}:
        return f"{SETTINGS_FILE} without a checkpoint"
    return None


def _convert_into(registry, provider, settings_file, assignments, hf_dir, hf_config, out, device) -> None:
    world, model = _build(registry, provider, settings_file, assignments, _precision(hf_config), device)
    state = world.plan.hooks.hf_to_mimo(settings=world.plan.settings, hf_config=hf_config,
                                        hf_tensors=safetensors_io.SafetensorsFolder(hf_dir))
    if state is None:
        raise UsageError(f"provider '{provider}' converts no Hugging Face model_type {hf_config.get('model_type')!r}")
    _load_whole_state(model, state, Path(hf_dir))
    del state
    checkpointer = _checkpointer(world, model, CheckpointOptions(save=Path(out), save_optim=False, save_rng=False))
    checkpointer.report_saves = False  # the caller says what it converted, and where
    checkpointer.save(0, 0)
    _finish_world()


def export_hf(checkpoint: Path, out: Path, assignments: list[str] = (), registry: Registry | None = None,
              device: str = "cpu") -> str:
    """Write the weights of a mimo checkpoint (saved under any layout) as a Hugging Face folder. Returns the
    provider's name."""
    safetensors_io.library()
    registry = registry or Registry()
    checkpoint = Path(checkpoint)
    iteration = read_tracker(checkpoint)
    if iteration is None:
        raise UsageError(f"no checkpoint in {checkpoint} ({TRACKER} is missing; give the save directory)")
    run = read_common(iteration_dir(checkpoint, iteration))["run"]
    with tempfile.TemporaryDirectory(prefix="mimo-export-") as scratch:
        settings_file = Path(scratch) / SETTINGS_FILE
        write_settings(settings_file, run["provider"], run["settings"])
        world, model = _build(registry, run["provider"], settings_file, list(assignments),
                              run["options"]["training"]["precision"], device)
    _checkpointer(world, model, CheckpointOptions(pretrained=checkpoint)).load()
    exported = world.plan.hooks.mimo_to_hf(settings=world.plan.settings, state=whole_state(model))
    if exported is None:
        raise UsageError(f"provider '{run['provider']}' exports no Hugging Face checkpoints (no mimo_to_hf hook)")
    hf_config, tensors = exported
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    hf_config.setdefault("dtype", "bfloat16" if dtypes == {torch.bfloat16} else "float32")
    safetensors_io.save(out, tensors, hf_config)
    _finish_world()
    return run["provider"]


# ------------------------------------------------------------------------------------ mimo run --pretrained


@contextlib.contextmanager
def pretrained_from_hf(plan, registry: Registry | None = None):
    """Yield the plan, its `--pretrained` pointing at a mimo checkpoint: a Hugging Face folder is converted first
    (in this process, before any worker starts; the workers find it through CONVERTED_ENV) and removed after."""
    c = plan.config.checkpoint
    if not is_hf_folder(c.pretrained) or (c.load and read_tracker(c.load) is not None):
        if c.pretrained and not is_hf_folder(c.pretrained):
            foreign_directory(c.pretrained)  # a folder holding no checkpoint is one line before workers start
        yield plan  # a mimo checkpoint, or a resumed run (--pretrained unused)
        return
    if os.environ.get(CONVERTED_ENV):
        yield _with_pretrained(plan, Path(os.environ[CONVERTED_ENV]))
        return
    from ..run.launch import external_world

    if external_world(plan.config.launch) is not None:  # torchrun's ranks, or an srun step's
        raise UsageError(f"--pretrained {c.pretrained} is a Hugging Face folder, which mimo converts before it "
                         f"starts workers: under torchrun/srun convert it first (mimo ckpt import-hf)")
    safetensors_io.library()
    registry = registry or Registry()
    hf_config = safetensors_io.read_config(c.pretrained)
    fields = registry.hooks(plan.config.provider).hf_settings(hf_config=hf_config)
    if fields is None:
        raise UsageError(f"--pretrained {c.pretrained}: provider '{plan.config.provider}' does not read Hugging "
                         f"Face model_type {hf_config.get('model_type')!r}")
    for name, value in fields.items():
        if plain_value(getattr(plan.settings, name)) != plain_value(value):
            raise UsageError(f"--pretrained {c.pretrained} has {name}={value!r}, this run's settings "
                             f"{getattr(plan.settings, name)!r} (use the --provider-config that mimo ckpt "
                             f"import-hf writes)")
    converted = Path(tempfile.mkdtemp(prefix="mimo-hf-pretrained-"))
    try:
        with tempfile.TemporaryDirectory(prefix="mimo-settings-") as scratch:
            settings_file = Path(scratch) / SETTINGS_FILE
            write_settings(settings_file, plan.config.provider, dataclasses.asdict(plan.settings))
            _convert_into(registry, plan.config.provider, settings_file, [], c.pretrained, hf_config, converted,
                          plan.config.training.device)
        gc.collect()  # the launching process keeps no model (nor, on a GPU, its cached memory) while workers train
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        os.environ[CONVERTED_ENV] = str(converted)
        os.environ[PRETRAINED_SOURCE_ENV] = str(c.pretrained)
        yield _with_pretrained(plan, converted)
    finally:
        os.environ.pop(CONVERTED_ENV, None)
        os.environ.pop(PRETRAINED_SOURCE_ENV, None)
        shutil.rmtree(converted, ignore_errors=True)


def _with_pretrained(plan, path: Path):
    config = dataclasses.replace(plan.config, checkpoint=dataclasses.replace(plan.config.checkpoint,
                                                                             pretrained=path))
    return dataclasses.replace(plan, config=config)
