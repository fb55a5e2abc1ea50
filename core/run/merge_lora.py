"""`mimo ckpt merge-lora`: a whole-model mimo checkpoint of a LoRA run's adapters folded into their base. It starts
as `mimo run` does (a world of one), builds the model with the run's adapters, loads the base (--pretrained, or the
one the checkpoint names) and the adapters, adds each adapter's `scale * B A` into its base weight in fp32 and saves
the result, weights only, with the adapters' settings and without adapters: `mimo run --pretrained OUT` trains on
from it, `mimo ckpt export-hf OUT` exports it.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from mimo.errors import UsageError

from ..adapters.apply import merge_adapters
from ..checkpoint import adapter_state, atomic_dir
from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.hf_export import export_hf, open_export
from ..checkpoint.hf_load import hf_loader
from ..checkpoint.layout import iteration_dir, read_common, read_tracker, run_info
from ..config import AdapterOptions, CheckpointOptions, RunConfig, TrainingOptions
from .plan import prepare
from .world import join

_BASES = ("pretrained", "pretrained_llm", "pretrained_vision")


def merge_lora(adapters: Path, out: Path, pretrained: Path | None = None, device: str = "cpu") -> tuple[str, str]:
    """Write the merged checkpoint of the LoRA checkpoint in `adapters` (a save directory) to `out`; the base is
    `pretrained` or the one the checkpoint records (checked: still there, the same weights). Returns (the
    provider's name, the base in words)."""
    iteration = read_tracker(adapters)
    if iteration is None:
        raise UsageError(f"merge-lora: no checkpoint in {adapters} (latest_checkpointed_iteration.txt is missing)")
    directory = iteration_dir(adapters, iteration)
    common = read_common(directory)
    if not common["contents"].get("adapters"):
        raise UsageError(f"merge-lora: {adapters} holds a whole model, no LoRA adapters: nothing to merge")
    run, record = common["run"], common["adapters"]
    options = run["options"]
    bases = {name: None for name in _BASES}
    if pretrained is not None:
        bases["pretrained"] = pretrained
    else:  # the folders the adapters were trained on: still there, the same weights
        bases.update(adapter_state.recorded_base(record, directory))
    training = options["training"]
    config = RunConfig(
        provider=run["provider"], provider_values=dict(run["settings"]), config_file=Path(adapters),
        adapters=AdapterOptions(**options["adapters"]),
        checkpoint=CheckpointOptions(load=Path(adapters), save=Path(out), save_optim=False, save_rng=False,
                                     load_optim=False, load_rng=False, load_scheduler=False, **bases),
        # the run's batch options too: `mimo eval` of the merged checkpoint then reads the batches the run's did
        training=TrainingOptions(train_iters=1, precision=training["precision"],
                                 **{k: training.get(k) for k in ("micro_batch_size", "global_batch_size",
                                                                 "num_microbatches")},
                                 seed=training["seed"] if record.get("seed") is None else record["seed"],
                                 device=device))
    plan = prepare(config, world_size=1)
    with atomic_dir.writing(Path(out), what="merge-lora", unfinished=lambda _: None) as folder:
        world = join(plan)
        model = world.build_model(trainable=False)
        loader = Checkpointer(config.checkpoint, model=model, topology=world.topology,
                              run_info=run_info(plan, plan.settings, lane_data_state=False),
                              load_hf=hf_loader(plan, model))
        loader.report_saves = False
        loader.load()
        merge_adapters(model)
        merged = dataclasses.replace(plan, config=dataclasses.replace(config, adapters=AdapterOptions()))
        saver = Checkpointer(dataclasses.replace(config.checkpoint, save=folder), model=model,
                             topology=world.topology, run_info=run_info(merged, plan.settings, lane_data_state=False))
        saver.report_saves = False
        saver.save(0, 0)
    _finish_world()
    return run["provider"], (f"--pretrained {pretrained}" if pretrained is not None else
                             f"{adapter_state.describe(record)}, recorded by {directory}")


def export_merged(adapters: Path, out: Path, assignments: list[str], max_shard_bytes: int) -> tuple[str, list[str]]:
    """`mimo ckpt export-hf` of a LoRA checkpoint (without --adapter-only): its adapters merged into the base
    its record names (checked: still there, the same weights), then the whole model exported. The merged
    checkpoint lives in a temporary folder beside OUT while it is exported. Returns (provider, notes)."""
    adapters, out = Path(adapters), Path(out)
    directory, common, _ = open_export(adapters, out, assignments, None)  # refusals that build nothing, first
    try:
        adapter_state.recorded_base(common["adapters"], directory)
    except UsageError as err:  # export-hf takes no --pretrained: merge-lora does
        raise UsageError(f"{err} (for export-hf: mimo ckpt merge-lora {adapters} MERGED --pretrained BASE, then "
                         f"mimo ckpt export-hf MERGED {out})") from None
    parent = out.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent, prefix=f".{out.name}.merged-") as scratch:
        merged = Path(scratch) / "merged"
        _, base = merge_lora(adapters, merged)
        name, notes = export_hf(merged, out, assignments, max_shard_bytes)
    return name, [f"{adapters} holds LoRA adapters: exported merged into their base {base} (fp32, as mimo ckpt "
                  f"merge-lora does; --adapter-only writes them as a PEFT adapter instead)", *notes]


def holds_adapters(checkpoint: Path) -> bool:
    """Whether the checkpoint a save directory tracks is a LoRA run's (adapters alone)."""
    iteration = read_tracker(checkpoint)
    return iteration is not None and bool(read_common(iteration_dir(checkpoint, iteration))["contents"].get("adapters"))


def _finish_world() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
