"""`mimo data sample DIR`: write a small synthetic energon captioning dataset, for smoke runs and tests.
`mimo data convert llava JSON IMAGE_DIR OUT`: LLaVA-style records and their images into an energon dataset."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from .help import PlainFlagsCommand, PlainFlagsGroup

data_app = typer.Typer(cls=PlainFlagsGroup, no_args_is_help=True, help="Datasets for `mimo run --data`.")


@data_app.callback()
def _group():
    """Datasets for `mimo run --data`."""  # a group even with one command, as `mimo data` and standalone


@data_app.command("sample", cls=PlainFlagsCommand)
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
    from mimo.wording import counted

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
        if directory.exists() and not directory.is_dir():
            raise UsageError(f"{directory} is a file: choose a new directory")
        if directory.exists() and any(directory.iterdir()):
            raise UsageError(f"{directory} is not empty: choose a new directory")
    except UsageError as err:
        raise fail(str(err)) from None
    # Which samples are corrupt follows the seed too, so a dataset can be written again exactly.
    corrupt_indices = sorted(random.Random(seed).sample(range(num_samples), corrupt))
    with prints_to_debug_log("energon prepare"):
        info = write_sample_dataset(directory, num_samples=num_samples, seed=seed, shard_size=shard_size,
                                    corrupt_indices=corrupt_indices, val_shards=val_shards)
    typer.echo(f"wrote {counted(info.num_samples, 'sample')} in {counted(len(info.shards), 'shard')} to "
               f"{info.path}"
               + (f" ({len(info.corrupt_keys)} corrupt: {', '.join(info.corrupt_keys)})" if corrupt else "")
               + (f"; val split: {', '.join(info.splits['val'])}" if val_shards else ""))


convert_app = typer.Typer(cls=PlainFlagsGroup, no_args_is_help=True,
                          help="Convert datasets of other formats into energon datasets.")
data_app.add_typer(convert_app, name="convert")


@convert_app.callback()
def _convert_group():
    """Convert datasets of other formats into energon datasets."""


@convert_app.command("llava", cls=PlainFlagsCommand)
def convert_llava(json_path: Path = typer.Argument(..., metavar="JSON", help="the records: a JSON array, or JSON lines"),
                  image_dir: Path = typer.Argument(..., metavar="IMAGE_DIR", help="where the records' image names "
                                                                                  "are found"),
                  out: Path = typer.Argument(..., metavar="OUT", help="the energon dataset to write (a new folder)"),
                  val_fraction: float = typer.Option(0.0, "--val-fraction", help="share of the records (by a hash of "
                                                     "their id) for the val split: held-out samples for "
                                                     "--eval-iters and mimo eval"),
                  test_fraction: float = typer.Option(0.0, "--test-fraction", help="share of the records (by the "
                                                      "same hash) for the test split: mimo eval --split test"),
                  shard_size: int = typer.Option(1000, "--shard-size", help="records per tar shard")):
    """LLaVA-style records ({"image": name or list, "conversations": [{"from", "value"}, ...]} or "messages") and
    their images into an energon dataset that `mimo run --data OUT` reads (webdataset shards, prepared, as a crude
    chat dataset). Records are read one at a time; <image> placeholders stay where they stand; a record mimo could
    not train on (a missing or undecodable image, placeholders that do not match the images, an unknown role) is
    named and counted, not written."""
    from mimo.data.convert import convert_llava as convert
    from mimo.errors import UsageError

    from .common import fail
    from .console import prints_to_debug_log

    console = sys.stdout  # the lines about bad records; energon's own prints go to the debug log
    try:
        if shard_size < 1:
            raise UsageError(f"--shard-size {shard_size} must be 1 or more")
        with prints_to_debug_log("energon prepare"):
            result = convert(json_path, image_dir, out, val_fraction=val_fraction, shard_size=shard_size,
                             say=lambda line: print(line, file=console, flush=True), test_fraction=test_fraction)
    except UsageError as err:
        raise fail(str(err)) from None
    typer.echo(result.summary())
