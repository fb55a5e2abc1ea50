"""`mimo ckpt inspect DIR`: what a checkpoint holds, read from its files alone (no process group, no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from mimo.errors import UsageError

ckpt_app = typer.Typer(no_args_is_help=True, help="Inspect checkpoints; import and export Hugging Face weights.")


@ckpt_app.command("inspect")
def inspect_checkpoint(directory: Path,
                       as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Iteration, the options and settings it was saved with, modules, parameter counts, layout and sizes.
    DIR is a save directory (its tracker names the checkpoint) or one iter_NNNNNNN directory."""
    from mimo.core.checkpoint.layout import TRACKER, iteration_dir, read_common, read_tracker
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
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
        return
    console = Console()
    console.print(f"[bold]{target}[/bold]: iteration {summary['iteration']}, {summary['consumed_samples']} samples "
                  f"consumed, provider {summary['provider']}, {summary['files']} files, "
                  f"{summary['size_bytes'] / 2**20:.1f} MiB, saved on {summary['world_size']} ranks")
    table = Table("module", "ranks", "TP", "DP", "PP", "EP", "parameters")
    for name, par in summary["layout"].items():
        count = summary["parameters"].get(name)
        table.add_row(name, f"{par['first_rank']}-{par['first_rank'] + par['num_ranks'] - 1}", str(par["tp"]),
                      str(par["dp"]), str(par["pp"]), str(par["ep"]), f"{count:,}" if count else "?")
    console.print(table)
    contents = summary["contents"]
    console.print(f"optimizer state: {'yes' if contents['optimizer'] else 'no'}"
                  f"{' (distributed, ' + contents['optimizer_sharding'] + ')' if contents.get('distributed_optimizer') else ''}"
                  f"; RNG state: {'yes' if contents['rng'] else 'no'}")
    console.print("provider settings: " + ", ".join(f"{k}={v}" for k, v in summary["settings"].items()))


@ckpt_app.command("import-hf")
def import_hf(hf_dir: Path, out: Path,
              provider: str = typer.Option(None, help="the provider to convert with (default: the one whose "
                                                      "plugin reads the folder's config.json)")):
    """Convert a Hugging Face model folder (config.json + safetensors) into a weights-only mimo checkpoint in OUT
    and OUT/provider.yaml (its provider and settings): train from it with `mimo run --provider-config
    OUT/provider.yaml --pretrained OUT`. One process on the CPU, the whole model in memory."""
    from mimo.core.checkpoint import hf
    from mimo.core.run.lifeline import install as die_with_parent

    from .common import fail

    die_with_parent()
    try:
        name = hf.import_hf(hf_dir, out, provider)
    except UsageError as err:
        raise fail(str(err)) from None
    typer.echo(f"imported {hf_dir} as provider {name}: train with mimo run --provider {name} --provider-config "
               f"{out / hf.SETTINGS_FILE} --pretrained {out}")


@ckpt_app.command("export-hf")
def export_hf(checkpoint: Path, out: Path,
              assignments: list[str] = typer.Option(None, "--set", help="override a saved provider setting for the "
                                                                 "conversion, key=value (e.g. backend=local)")):
    """Write the weights of a mimo checkpoint (CHECKPOINT: its save directory; any layout) as a Hugging Face
    model folder OUT that transformers' from_pretrained loads. One process on the CPU, the whole model in memory."""
    from mimo.core.checkpoint import hf
    from mimo.core.run.lifeline import install as die_with_parent

    from .common import fail

    die_with_parent()
    try:
        name = hf.export_hf(checkpoint, out, assignments or [])
    except UsageError as err:
        raise fail(str(err)) from None
    typer.echo(f"exported {checkpoint} (provider {name}) to {out}")
