"""Building an energon train loader for this project's task encoder, with skipped samples counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron.energon import WorkerConfig, get_loader, get_train_dataset

from .skips import SkippedSampleCounter

__all__ = ["get_multimodal_train_loader", "make_worker_config"]


def make_worker_config(*, rank: int = 0, world_size: int = 1, num_workers: int = 0, seed_offset: int = 0,
                       skip_counter: SkippedSampleCounter | None = None, **kwargs) -> WorkerConfig:
    """A WorkerConfig whose error handler is `skip_counter` (a fresh counter when not given): a sample that fails to
    load or encode is counted and dropped instead of crashing the run."""
    counter = skip_counter if skip_counter is not None else SkippedSampleCounter()
    return WorkerConfig(rank=rank, world_size=world_size, num_workers=num_workers, seed_offset=seed_offset,
                        global_error_handler=counter, **kwargs)


def get_multimodal_train_loader(path: str | Path, task_encoder, *, batch_size: int, rank: int = 0,
                                world_size: int = 1, num_workers: int = 0, seed_offset: int = 0,
                                shuffle_buffer_size: int | None = None,
                                max_samples_per_sequence: int | None = None,
                                packing_buffer_size: int | None = None, repeat: bool = True,
                                skip_counter: SkippedSampleCounter | None = None,
                                **dataset_kwargs: Any):
    """(loader, skip_counter): energon's train dataset at `path` for this data-parallel `rank`, encoded and batched
    by `task_encoder`. Read this way (not through the lane loader), a sample that fails, the task encoder's own
    rejections included (e.g. too long for the sequence), is dropped by energon and counted when dropped."""
    counter = skip_counter if skip_counter is not None else SkippedSampleCounter()
    worker_config = make_worker_config(rank=rank, world_size=world_size, num_workers=num_workers,
                                       seed_offset=seed_offset, skip_counter=counter)
    if getattr(task_encoder, "pack_sequences", False) and packing_buffer_size is None:
        raise ValueError("the task encoder packs sequences: pass packing_buffer_size")
    dataset = get_train_dataset(
        str(path), worker_config=worker_config, batch_size=batch_size, shuffle_buffer_size=shuffle_buffer_size,
        max_samples_per_sequence=max_samples_per_sequence, packing_buffer_size=packing_buffer_size,
        task_encoder=task_encoder, repeat=repeat, **dataset_kwargs,
    )
    return get_loader(dataset), counter
