"""`mimo ckpt inspect DIR`: what a checkpoint holds, read from its files alone (no process group, no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from mimo.errors import UsageError
from mimo.wording import counted

from .help import PlainFlagsCommand, PlainFlagsGroup

ckpt_app = typer.Typer(cls=PlainFlagsGroup, no_args_is_help=True,
                       help="Inspect checkpoints; import and export Hugging Face weights.")


@ckpt_app.command("inspect", cls=PlainFlagsCommand)
def inspect_checkpoint(directory: Path,
                       as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Iteration, the options and settings it was saved with, modules, parameter counts, layout and sizes.
    DIR is a save directory (its tracker names the checkpoint) or one iter_NNNNNNN directory."""
    from mimo.core.checkpoint.layout import TRACKER, iteration_dir, read_common, read_tracker
    from mimo.core.checkpoint.save_dir import names
    from mimo.errors import UsageError

    from .common import fail

    try:
        target = directory
        if (directory / TRACKER).exists() or not (directory / "metadata.json").exists():
            iteration = read_tracker(directory)
            if iteration is None:
                raise UsageError(f"no checkpoint in {directory} ({TRACKER} is missing)")
            target = iteration_dir(directory, iteration)
        common = read_common(target)
    except UsageError as err:
        raise fail(str(err)) from None
    files = [p for p in target.iterdir() if p.is_file()]
    summary = {
        "directory": str(target), "iteration": common["iteration"], "consumed_samples": common["consumed_samples"],
        "checkpoint_version": common["checkpoint_version"], "provider": common["run"]["provider"],
        "contents": common["contents"], "layout": common["run"]["layout"],
        "world_size": common["run"]["world_size"], "parameters": common["run"]["parameters"],
        "size_bytes": sum(p.stat().st_size for p in files), "files": len(files),
        "settings": common["run"]["settings"], "options": common["run"]["options"],
        "series": common.get("series"), "save_directory": _save_directory(target.parent, common.get("series")),
    }
    if common["contents"].get("adapters"):
        from .inspect_adapters import adapters_summary

        summary["adapters"] = adapters_summary(target, common)
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
        return
    console = Console()
    adapters = summary.get("adapters")
    console.print(f"[bold]{target}[/bold]: iteration {summary['iteration']}, "
                  f"{counted(summary['consumed_samples'], 'sample')} consumed, provider {summary['provider']}, "
                  f"{counted(summary['files'], 'file')}, {summary['size_bytes'] / 2**20:.1f} MiB"
                  f"{' (LoRA adapters alone)' if adapters else ''}, saved on {counted(summary['world_size'], 'rank')}")
    counts = ("base parameters", "adapter parameters") if adapters else ("parameters",)
    table = Table("module", "ranks", "TP", "DP", "PP", "EP", *counts)
    for name, par in summary["layout"].items():
        count = summary["parameters"].get(name)
        extra = [f"{adapters['parameters'].get(name, 0):,}"] if adapters else []
        table.add_row(name, f"{par['first_rank']}-{par['first_rank'] + par['num_ranks'] - 1}", str(par["tp"]),
                      str(par["dp"]), str(par["pp"]), str(par["ep"]), f"{count:,}" if count else "?", *extra)
    console.print(table)
    if adapters:
        from .inspect_adapters import adapter_lines

        for line in adapter_lines(adapters):
            console.print(line, highlight=False)
    contents = summary["contents"]
    console.print(f"optimizer state: {'yes' if contents['optimizer'] else 'no'}"
                  f"{' (distributed, ' + contents['optimizer_sharding'] + ')' if contents.get('distributed_optimizer') else ''}"
                  f"; RNG state: {'yes' if contents['rng'] else 'no'}")
    console.print("provider settings: " + ", ".join(f"{k}={v}" for k, v in summary["settings"].items()))
    held = summary["save_directory"]
    if held["other_runs"] or held["unfinished"]:
        console.print(f"also in {target.parent}: " + "; ".join(
            part for part in (f"{len(held['this_run'])} checkpoints of this run" if held["this_run"] else "",
                              f"{names(held['other_runs'])} of other runs (complete, kept)" if held["other_runs"]
                              else "",
                              f"{names(held['unfinished'])} unfinished (removed by the next run saving here)"
                              if held["unfinished"] else "") if part), soft_wrap=True)


def _save_directory(root: Path, series) -> dict:
    """The complete checkpoints beside the inspected one, this run's and other runs' (`--start-anew` keeps them),
    and folders of saves cut short."""
    from mimo.core.checkpoint.save_dir import survey

    found = survey(root)
    return {"this_run": sorted(it for it, s in found.complete.items() if s == series),
            "other_runs": sorted(it for it, s in found.complete.items() if s != series),
            "unfinished": sorted(int(p.name[5:]) for p in found.unfinished)}


@ckpt_app.command("import-hf", cls=PlainFlagsCommand)
def import_hf(paths: list[Path] = typer.Argument(..., metavar="[HF_DIR] OUT", show_default=False,
                                                help="a Hugging Face model folder and the checkpoint to write; OUT "
                                                     "alone with --llm / --vision"),
              llm: Path = typer.Option(None, "--llm", help="a Hugging Face folder of the language model alone "
                                                           "(nemotron_h): the VLM's LLM"),
              vision: Path = typer.Option(None, "--vision", help="a Hugging Face folder of the vision encoder alone "
                                                                 "(radio): the VLM's encoder"),
              provider: str = typer.Option(None, help="the provider to read it with (default: the one whose "
                                                      "plugin reads the config.json files)"),
              assignments: list[str] = typer.Option(None, "--set", help="a setting the folders do not determine, "
                                                                 "key=value (e.g. projection=mlp for the projector "
                                                                 "of --llm and --vision); kept in provider.yaml")):
    """Write a weights-only mimo checkpoint in OUT, and OUT/provider.yaml (its provider and settings), of a Hugging
    Face model folder, or of a VLM assembled from an LLM (--llm) and a vision encoder (--vision), the rest starting
    from the provider's initialization: train from it with `mimo run --provider-config OUT/provider.yaml
    --pretrained OUT`. One process, streaming: it holds the model and one read buffer."""
    from mimo.core.checkpoint import hf
    from mimo.core.run import import_hf as importer
    from mimo.core.run.lifeline import install as die_with_parent

    from .common import fail

    die_with_parent()
    try:
        if len(paths) > 2 or (len(paths) == 2) == bool(llm or vision):
            raise UsageError("import-hf takes HF_DIR OUT, or OUT with --llm DIR and/or --vision DIR")
        hf_dir, out = (paths[0], paths[1]) if len(paths) == 2 else (None, paths[0])
        name = importer.import_hf(out, hf_dir, llm, vision, provider, assignments or [])
    except UsageError as err:
        raise fail(str(err)) from None
    sources = " and ".join(str(p) for p in (hf_dir, llm, vision) if p)
    typer.echo(f"imported {sources} as provider {name}: train with mimo run --provider {name} --provider-config "
               f"{out / hf.SETTINGS_FILE} --pretrained {out}")


@ckpt_app.command("merge-lora", cls=PlainFlagsCommand)
def merge_lora(adapters: Path, out: Path,
               pretrained: Path = typer.Option(None, help="the base the adapters were trained on (default: the one "
                                                          "their checkpoint names; either must hold the same "
                                                          "weights by their fingerprint)")):
    """Fold the LoRA adapters of a run's checkpoint (ADAPTERS: its save directory) into their base and write the
    whole model as a weights-only mimo checkpoint OUT (fp32 arithmetic, stored in the run's precision): train on
    with `mimo run --pretrained OUT`, export with `mimo ckpt export-hf OUT HF_DIR`. One process."""
    from mimo.core.run import merge_lora as merger
    from mimo.core.run.lifeline import install as die_with_parent

    from .common import fail

    die_with_parent()
    try:
        name, base = merger.merge_lora(adapters, out, pretrained)
    except UsageError as err:
        raise fail(str(err)) from None
    typer.echo(f"merged the adapters of {adapters} into their base {base} (provider {name}): {out}")


@ckpt_app.command("export-hf", cls=PlainFlagsCommand)
def export_hf(checkpoint: Path, out: Path,
              assignments: list[str] = typer.Option(None, "--set", help="change a saved setting that only decides "
                                                                 "what goes beside the weights, key=value (e.g. "
                                                                 "tokenizer_path=DIR); one that changes the model "
                                                                 "is refused"),
              max_shard_size: str = typer.Option("5GB", help="largest safetensors shard (e.g. 500MB, 5GB); more "
                                                             "than one shard gets model.safetensors.index.json"),
              adapter_only: bool = typer.Option(False, "--adapter-only", help="CHECKPOINT holds LoRA adapters: write "
                                                "them as a PEFT adapter folder (adapter_config.json, "
                                                "adapter_model.safetensors) for peft.PeftModel.from_pretrained on "
                                                "the Hugging Face model of their base")):
    """Write the weights of a mimo checkpoint (CHECKPOINT: its save directory; any layout) as a Hugging Face
    model folder OUT that transformers loads (AutoModelForImageTextToText, AutoProcessor), with its tokenizer
    and processor files; with --adapter-only, a LoRA run's adapters as a PEFT adapter. Streaming, in one process:
    no model is built. A LoRA run's checkpoint without --adapter-only: its adapters merged into the base it
    records first (as mimo ckpt merge-lora, into a temporary folder beside OUT), then the whole model."""
    from mimo.core.checkpoint import hf_export, peft_export
    from mimo.core.run import merge_lora
    from mimo.core.run.lifeline import install as die_with_parent

    from .common import fail

    die_with_parent()
    try:
        if adapter_only:
            name, notes = peft_export.export_peft(checkpoint, out, assignments or [])
        elif merge_lora.holds_adapters(checkpoint):
            name, notes = merge_lora.export_merged(checkpoint, out, assignments or [], parse_size(max_shard_size))
        else:
            name, notes = hf_export.export_hf(checkpoint, out, assignments or [], parse_size(max_shard_size))
    except UsageError as err:
        raise fail(str(err)) from None
    for note in notes:
        typer.echo(f"note: {note}")
    typer.echo(f"exported {checkpoint} (provider {name}) to {out}")


UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """"5GB", "500MB", "100KiB", "1000000" -> bytes (transformers' units: GB is 10^9, GiB 2^30)."""
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.I)
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"--max-shard-size {text!r}: give a size such as 500MB or 5GB")
    return int(float(match.group(1)) * UNITS[(match.group(2) or "").upper()])
