"""`mimo ckpt merge-lora`: a whole-model mimo checkpoint of a LoRA run's adapters folded into their base. It starts
as `mimo run` does (a world of one), builds the model with the run's adapters, loads the base (--pretrained, or the
one the checkpoint names) and the adapters, adds each adapter's `scale * B A` into its base weight in fp32 and saves
the result, weights only, with the adapters' settings and without adapters: `mimo run --pretrained OUT` trains on
from it, `mimo ckpt export-hf OUT` exports it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mimo.errors import UsageError

from ..adapters.apply import merge_adapters
from ..checkpoint import atomic_dir
from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.hf_load import hf_loader
from ..checkpoint.layout import iteration_dir, read_common, read_tracker, run_info
from ..config import AdapterOptions, CheckpointOptions, RunConfig, TrainingOptions
from .plan import prepare
from .world import join

_BASES = ("pretrained", "pretrained_llm", "pretrained_vision")


def merge_lora(adapters: Path, out: Path, pretrained: Path | None = None, device: str = "cpu") -> str:
    """Write the merged checkpoint of the LoRA checkpoint in `adapters` (a save directory) to `out`; the base is
    `pretrained` or the one the checkpoint records. Returns the provider's name."""
    iteration = read_tracker(adapters)
    if iteration is None:
        raise UsageError(f"merge-lora: no checkpoint in {adapters} (latest_checkpointed_iteration.txt is missing)")
    common = read_common(iteration_dir(adapters, iteration))
    if not common["contents"].get("adapters"):
        raise UsageError(f"merge-lora: {adapters} holds a whole model, no LoRA adapters: nothing to merge")
    run, record = common["run"], common["adapters"]
    options = run["options"]
    bases = {name: None for name in _BASES}
    if pretrained is not None:
        bases["pretrained"] = pretrained
    else:  # the folders the adapters were trained on, checked again by their checksums when loading
        bases.update({name: Path(folder["path"]) for name, folder in record.get("folders", {}).items()})
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
    return run["provider"]


def _finish_world() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
