"""`mimo data sample DIR`: write a small synthetic energon captioning dataset, for smoke runs and tests."""

from __future__ import annotations

from pathlib import Path

import typer

data_app = typer.Typer(no_args_is_help=True, help="Datasets for `mimo run --data`.")


@data_app.callback()
def _group():
    """Datasets for `mimo run --data`."""  # a group even with one command, as `mimo data` and standalone


@data_app.command("sample")
def sample(directory: Path,
           num_samples: int = typer.Option(64, "--num-samples", help="captioned images to write"),
           seed: int = typer.Option(0, "--seed", help="the same seed writes the same dataset"),
           corrupt: int = typer.Option(0, "--corrupt", help="samples whose image bytes cannot be decoded "
                                                            "(to see them skipped and counted)"),
           shard_size: int = typer.Option(16, "--shard-size", help="samples per tar shard"),
           val_shards: int = typer.Option(0, "--val-shards", help="the last N shards form the val split (held-out "
                                                                  "samples for --eval-iters and mimo eval)")):
    """Images of shapes in varying sizes and aspect ratios with captions that name them, as WebDataset shards
    prepared with energon's own tooling. Train on it: mimo run --provider mock-vlm --data DIR"""
    import random

    from mimo.data import write_sample_dataset
    from mimo.errors import UsageError

    from .common import fail
    from .console import prints_to_debug_log

    try:
        if num_samples < 1:
            raise UsageError(f"--num-samples {num_samples} must be 1 or more")
        if not 0 <= corrupt <= num_samples:
            raise UsageError(f"--corrupt {corrupt} must lie between 0 and --num-samples {num_samples}")
        if shard_size < 1:
            raise UsageError(f"--shard-size {shard_size} must be 1 or more")
        shards = -(-num_samples // shard_size)
        if not 0 <= val_shards < shards:
            raise UsageError(f"--val-shards {val_shards} must leave training shards: use 0 to {shards - 1} "
                             f"({num_samples} samples make {shards} shards of {shard_size})")
        if directory.exists() and any(directory.iterdir()):
            raise UsageError(f"{directory} is not empty: choose a new directory")
    except UsageError as err:
        raise fail(str(err)) from None
    # Which samples are corrupt follows the seed too, so a dataset can be written again exactly.
    corrupt_indices = sorted(random.Random(seed).sample(range(num_samples), corrupt))
    with prints_to_debug_log("energon prepare"):
        info = write_sample_dataset(directory, num_samples=num_samples, seed=seed, shard_size=shard_size,
                                    corrupt_indices=corrupt_indices, val_shards=val_shards)
    typer.echo(f"wrote {info.num_samples} samples in {len(info.shards)} shards to {info.path}"
               + (f" ({len(info.corrupt_keys)} corrupt: {', '.join(info.corrupt_keys)})" if corrupt else "")
               + (f"; val split: {', '.join(info.splits['val'])}" if val_shards else ""))
