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


# -- looking at a dataset: `mimo data inspect`, `mimo data preview` ------------------------------------------------

# The loop options that change what the provider's task encoder is (its settings from Hugging Face folders, packing)
VIEW_LOOP_OPTIONS = ("pretrained", "pretrained_llm", "pretrained_vision", "pack_sequences", "packing_buffer_size",
                     "pack_image_tokens")
PROVIDER_NAMING = ("provider", "config", "provider_config")
_FOLDER = " a run starts from: the provider settings it determines apply, as in mimo run"
_VIEW_HELP = {"pretrained": "a Hugging Face folder" + _FOLDER,
              "pretrained_llm": "a Hugging Face folder of the language model" + _FOLDER,
              "pretrained_vision": "a Hugging Face folder of the vision encoder" + _FOLDER}


def _view_parameters(own: list) -> list:
    import inspect as signature
    import typing
    from typing import Annotated

    from .options import CONTEXT, loop_parameters, provider_parameters

    def param(name, kind, default, *names, **option):
        return signature.Parameter(name, signature.Parameter.KEYWORD_ONLY, default=default,
                                   annotation=Annotated[kind, typer.Option(*names, **option)])

    dataset = signature.Parameter("dataset", signature.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[
        Path, typer.Argument(metavar="DATASET", help="an energon dataset folder or metadataset file (as --data)")])
    common = [param("split", str, "train", "--split", help="which split to read: train, val, test"),
              param("seq_length", typing.Optional[int], None, "--seq-length",
                    help="the provider's seq_length (--set seq_length=N)")]
    loop = [p for p in loop_parameters() if p.name in VIEW_LOOP_OPTIONS]
    for p in loop:
        if p.name in _VIEW_HELP:
            typing.get_args(p.annotation)[1].help = _VIEW_HELP[p.name]
    mine = [param(name, kind, default, flag, **option) for name, kind, default, flag, option in own]
    return [CONTEXT, dataset] + common + mine + provider_parameters() + loop


def _encoder(ctx, dataset: Path, split: str, seq_length, kwargs: dict):
    """(provider name, its task encoder) for the options, or (None, None) when they name no provider."""
    import dataclasses

    from mimo.core.config import COMPONENTS
    from mimo.errors import UsageError

    from .options import run_config

    if not any(kwargs.get(name) for name in PROVIDER_NAMING):
        given = [flag for flag, value in (("--seq-length", seq_length), ("--set", kwargs.get("set")),
                                          ("--pretrained", kwargs.get("pretrained"))) if value]
        if given:
            raise UsageError(f"{given[0]} needs --provider NAME: the provider's tokenizer, chat template and images "
                             f"count the tokens (see: mimo providers list)")
        return None, None
    from mimo.core.run.data_encoder import provider_encoder

    defaults = {f.name: f.default for c in COMPONENTS for f in dataclasses.fields(c.options)}
    sets = list(kwargs.get("set") or []) + ([f"seq_length={seq_length}"] if seq_length is not None else [])
    config = run_config({**defaults, **kwargs, "set": sets, "data": dataset}, ctx)
    found = provider_encoder(config, split)
    return found.provider, found.encoder


def _inspect(ctx: typer.Context, dataset: Path, split: str = "train", seq_length=None, limit: int = 1000,
             as_json: bool = False, **kwargs):
    """What a dataset holds, from its first --limit samples: splits, sample counts, formats, images per sample and
    their sizes, samples that cannot be read; with --provider (and --set, --seq-length as for mimo run), as that
    provider encodes them: patches and tokens per image, text, image, total and trained tokens per sample
    (percentiles and a histogram), what seq_length cuts, and how full the packed rows would be."""
    import json

    from mimo.data.inspection import inspect_dataset
    from mimo.errors import UsageError
    from mimo.plugins.context import packing_buffer_for

    from .common import fail
    from .console import prints_to_debug_log

    try:
        if limit < 0:
            raise UsageError(f"--limit {limit} must be 0 (all) or more")
        provider, encoder = _encoder(ctx, dataset, split, seq_length, kwargs)
        with prints_to_debug_log("energon"):
            # the run's packing buffer, and its image budget where given (a run's default is the memory plan's)
            if encoder is not None:
                encoder.image_token_budget = kwargs.get("pack_image_tokens")
            buffer = kwargs.get("packing_buffer_size") or (packing_buffer_for(encoder.seq_length) if encoder else 64)
            result = inspect_dataset(dataset, split, limit or None, encoder, provider, buffer_size=buffer,
                                     command="mimo data inspect")
    except UsageError as err:
        raise fail(str(err)) from None
    typer.echo(json.dumps(result.as_dict(), indent=1) if as_json else "\n".join(result.lines()))


def _preview(ctx: typer.Context, dataset: Path, split: str = "train", seq_length=None, count: int = 3,
             chars: int = 200, **kwargs):
    """The first -n samples as a provider's task encoder hands them to the model: each turn with its role, its
    text as the tokens decode (template markers included), each image as <image WxH: patches, tokens>, and the
    tokens that carry loss between [[ and ]]. Without --provider: the turns and images as read."""
    import itertools

    from mimo.data.preview import preview_lines
    from mimo.data.sample_reader import SampleReader
    from mimo.data.sample_view import Viewer
    from mimo.errors import UsageError

    from .common import fail
    from .console import prints_to_debug_log

    try:
        if count < 1:
            raise UsageError(f"-n {count} must be 1 or more")
        provider, encoder = _encoder(ctx, dataset, split, seq_length, kwargs)
        with prints_to_debug_log("energon"):
            reader = SampleReader(dataset, split, encoder, f"provider '{provider}'" if provider else "mimo",
                                  "mimo data preview")
            viewer = Viewer(encoder)
            views = [viewer.view(read) for read in itertools.islice(reader, count)]
    except UsageError as err:
        raise fail(str(err)) from None
    for line in _coloured(preview_lines(views, encoder, provider, [m.path for m in reader.members], chars)):
        typer.echo(line)


def _coloured(lines: list[str]) -> list[str]:
    """The trained spans ([[ ... ]], which may run over several lines) in green; the markers stay, so the lines
    read the same without colour (typer drops the colour where the output is not a terminal)."""
    from mimo.data.preview import CLOSE, OPEN

    out, inside = [], False
    for line in lines:
        pieces, rest = [], line
        while rest:
            mark = rest.find(CLOSE if inside else OPEN)
            end = len(rest) if mark < 0 else mark + (len(CLOSE) if inside else 0)
            chunk, rest = rest[:end], rest[end:]
            pieces.append(typer.style(chunk, fg=typer.colors.GREEN) if inside and chunk else chunk)
            if mark < 0:
                break
            inside = not inside
        out.append("".join(pieces))
    return out


def _register_views() -> None:
    from .help import WholeNamesCommand
    from .options import with_options

    data_app.command("inspect", cls=WholeNamesCommand)(with_options(_inspect, _view_parameters([
        ("limit", int, 1000, "--limit", dict(help="read at most this many samples (a blend: in all); 0: the whole "
                                                  "split")),
        ("as_json", bool, False, "--json", dict(help="print the figures as JSON")),
    ])))
    data_app.command("preview", cls=WholeNamesCommand)(with_options(_preview, _view_parameters([
        ("count", int, 3, "-n", dict(help="how many samples to show")),
        ("chars", int, 200, "--chars", dict(help="shorten each run of text to about this many characters (0: "
                                                 "never)")),
    ])))


_register_views()
