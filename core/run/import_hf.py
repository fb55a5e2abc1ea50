"""`mimo ckpt import-hf`: a mimo checkpoint of a Hugging Face model folder, or of a VLM assembled from an LLM and a
vision encoder. It starts as `mimo run` does (a world of one), loads the folders through the per-rank loader and
saves weights only; nothing trains, so no gradient buffers exist: the process holds the model and one read buffer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mimo.errors import UsageError
from mimo.plugins import Registry
from mimo.plugins.kit.safetensors_io import is_hf_folder, read_config
from mimo.plugins.settings import given_settings

from ..checkpoint import atomic_dir
from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.hf import (SETTINGS_FILE, check_sources, find_provider, hf_sources, hf_sources_of, precision_of,
                             write_settings)
from ..checkpoint.hf_load import load_hf
from ..checkpoint.layout import TRACKER, run_info
from ..config import CheckpointOptions, RunConfig, TrainingOptions
from .plan import prepare
from .world import join


def import_hf(out: Path, hf_dir: Path | None = None, llm: Path | None = None, vision: Path | None = None,
              provider: str | None = None, assignments: list[str] = (), registry: Registry | None = None,
              device: str = "cpu") -> str:
    """A weights-only mimo checkpoint in `out` (and `out/provider.yaml`) of a Hugging Face model folder, or of a
    VLM assembled from an LLM and a vision encoder (the rest seeded as `mimo run` initializes it, with the
    settings `assignments` give it, e.g. projection=mlp). In this process, streaming: it holds the model and one
    read buffer. Returns the provider's name."""
    registry = registry or Registry()
    options = CheckpointOptions(pretrained=hf_dir, pretrained_llm=llm, pretrained_vision=vision)
    sources = hf_sources(options)
    if hf_dir is not None and not is_hf_folder(hf_dir):
        raise UsageError(f"{hf_dir} is not a Hugging Face model folder (config.json with model.safetensors or "
                         f"model.safetensors.index.json)")
    if not sources or (hf_dir is not None and (llm or vision)):
        raise UsageError("import-hf takes a model folder HF_DIR, or its parts --llm DIR and/or --vision DIR")
    configs = {part: read_config(folder) for part, folder in sources}
    provider, fields = find_provider(registry, configs, provider)
    out = Path(out)
    precision = precision_of(configs.values())
    config = RunConfig(provider=provider, provider_settings=list(assignments),
                       checkpoint=dataclasses.replace(options, save=out, save_optim=False, save_rng=False),
                       training=TrainingOptions(micro_batch_size=1, train_iters=1, precision=precision, device=device))
    plan = prepare(config, registry, world_size=1)  # the folders' settings, then --set (one line per mismatch)
    check_sources(plan)
    chosen = given_settings(plan.provider, list(assignments))
    # written into a partial folder renamed to OUT at the end: a killed import leaves no OUT to trip on
    with atomic_dir.writing(out, what="import", unfinished=unfinished_import) as folder:
        write_settings(folder / SETTINGS_FILE, provider, {**fields, **{k: getattr(plan.settings, k) for k in chosen}})
        world = join(plan)  # seeded as `mimo run` is: the parts' projector starts where a run's would
        model = world.build_model(trainable=False)  # no gradient buffers: nothing trains here
        load_hf(model, hf_sources_of(plan))
        checkpointer = Checkpointer(dataclasses.replace(config.checkpoint, save=folder), model=model,
                                    topology=world.topology,
                                    run_info=run_info(plan, plan.settings, lane_data_state=False))
        checkpointer.report_saves = False  # the caller says what it imported, and where
        checkpointer.save(0, 0)
    _finish_world()
    return provider


def unfinished_import(out: Path) -> str | None:
    """Why `out` looks like an import an older mimo left unfinished in place (provider.yaml, no tracker), or None."""
    names = {p.name for p in out.iterdir()}
    if SETTINGS_FILE in names and TRACKER not in names and names <= {SETTINGS_FILE, "iter_0000000", ".mimo-lock"}:
        return f"{SETTINGS_FILE} without a checkpoint"
    return None


def _finish_world() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
