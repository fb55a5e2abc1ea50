"""The `mimo` command."""

from __future__ import annotations

import inspect
import sys
import typing
from pathlib import Path
from typing import Annotated

import typer

from mimo.errors import TrainingStopped, UsageError

from . import console
from .common import fail, start_workers
from .help import PlainFlagsGroup, WholeNamesCommand
from .options import CONTEXT, given_on_command_line, loop_parameters, provider_parameters, with_options
from . import generate
from .ckpt import ckpt_app
from .data import data_app
from .providers import providers_app

app = typer.Typer(cls=PlainFlagsGroup, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Train multimodal models on megatron-core; model families come as provider plugins.")
app.add_typer(providers_app, name="providers")
app.add_typer(ckpt_app, name="ckpt")
app.add_typer(data_app, name="data")


def _print_version(value: bool) -> None:
    if value:
        from .version import report

        console.configure()
        typer.echo("\n".join(report()))
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=_print_version, help="print the versions of mimo, torch, megatron-core "
        "and energon, and whether transformer-engine and mamba-ssm are usable, then exit")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="also show the libraries' notices (megatron-core, "
                                          "energon, torch) on stderr; by default only mimo's lines show")] = False,
    log_file: Annotated[typing.Optional[Path], typer.Option(
        "--log-file", help="write the libraries' notices and debug messages to this file (every rank appends)")] = None,
):
    """Train multimodal models on megatron-core; model families come as provider plugins."""
    console.configure(verbose, log_file)


def _run(ctx: typer.Context, print_config: bool = False, **kwargs):
    """Train a provider's model. Loop options only; the model's own settings go through --set/--provider-config
    (or a whole run in one --config file)."""
    from mimo.core import run_file
    from mimo.core.run import launch, preflight
    from mimo.core.run.loop import train
    from mimo.core.run.lifeline import install as die_with_parent
    from mimo.core.run.plan import prepare

    die_with_parent()  # what this process forks dies with it, whatever kills it
    launch.die_with_launcher()
    from .checkpoint_config import config_for_run

    try:
        config, taken = config_for_run(kwargs, ctx)  # resuming: the checkpoint's provider and settings
        if taken and not print_config and launch.speaks_for_run(config.launch):
            print("\n".join(taken), flush=True)
        if print_config:
            plan = prepare(config)
            typer.echo(run_file.dump(plan.config, plan.settings), nl=False)
            return
        with preflight.for_run(config) as plan:
            if launch.needs_launcher(plan.config.launch):
                raise typer.Exit(code=start_workers(plan))
            train(plan)
    except UsageError as err:
        if getattr(err, "quiet", False):  # a stop for the data: one rank says it for the run
            raise typer.Exit(code=2) from None
        raise fail(str(err)) from None
    except TrainingStopped as err:
        if not getattr(err, "quiet", False):  # a stop on a signal: one rank says it for the run
            typer.secho(f"error: {err}", err=True, fg=typer.colors.RED)
        raise typer.Exit(code=1) from None


app.command("run", cls=WholeNamesCommand)(with_options(_run, [CONTEXT] + provider_parameters() + [
    inspect.Parameter("print_config", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[
        bool, typer.Option("--print-config", rich_help_panel="Provider",
                           help="print the run's effective configuration as a --config file (every option and "
                                "setting) and exit without training")]),
] + loop_parameters()))


def _eval(ctx: typer.Context, split: str = "val", json_path=None, **kwargs):
    """Evaluate a checkpoint without training: its held-out loss on --data's val (or test) split, or the
    provider's synthetic eval data, over --eval-iters global batches (default 10), in any layout that fits."""
    from mimo.core.run import launch, preflight
    from mimo.core.run.evaluate import evaluate_checkpoint
    from mimo.core.run.output_paths import check_output_file
    from mimo.core.run.lifeline import install as die_with_parent

    from .checkpoint_config import config_from_checkpoint

    die_with_parent()
    launch.die_with_launcher()
    try:
        if json_path is not None:
            check_output_file("--json", json_path)
        if kwargs.get("eval_iters") == 0 and "eval_iters" in given_on_command_line(ctx):  # 0 is "not given" below
            raise UsageError("mimo eval --eval-iters 0: an evaluation reads at least one global batch; give K >= 1, "
                             "or leave it out for the run's (else 10)")
        config, report = config_from_checkpoint(kwargs, ctx, "eval")  # the checkpoint's provider and settings
        with preflight.for_eval(config, split) as plan:
            if report is not None and not launch.is_launched_worker():
                print("\n".join(report(plan)), flush=True)
            if launch.needs_launcher(plan.config.launch):
                raise typer.Exit(code=start_workers(plan))
            evaluate_checkpoint(plan, split, json_path)
    except UsageError as err:
        raise fail(str(err)) from None


app.command("eval", cls=WholeNamesCommand)(with_options(_eval, [
    CONTEXT,
    inspect.Parameter("split", inspect.Parameter.KEYWORD_ONLY, default="val", annotation=Annotated[
        str, typer.Option("--split", help="which split of --data to evaluate: val or test")]),
    inspect.Parameter("json_path", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        typing.Optional[Path], typer.Option("--json", help="write the figures to this JSON file")]),
] + provider_parameters() + loop_parameters()))


generate.register(app)


def _plan(ctx: typer.Context, as_json: bool = False, suggest: bool = False, gpus: typing.Optional[int] = None,
          **kwargs):
    """Show which ranks run which module with which TP/DP/PP/EP, parameter counts, the memory estimate per GPU,
    and whether the layout is valid and fits (exit 2 if not), for the same options as `mimo run`, without
    starting workers. With --suggest --gpus N: the layouts of N GPUs that fit, most tokens/s/GPU first, and the
    `mimo run` command of the first."""
    from mimo.core.memory import fit
    from mimo.core.run.plan import prepare

    from .checkpoint_config import config_for_run
    from .plan import describe, print_plan
    from .suggest import print_suggestions, typed_options

    try:
        config, _ = config_for_run(kwargs, ctx)  # as `mimo run` takes it: a resumed checkpoint's run and base
        if suggest or gpus is not None:
            if not (suggest and gpus):
                raise UsageError("--suggest and --gpus N go together (N >= 1): list the layouts of N GPUs that fit")
            print_suggestions(config, gpus, as_json, typed_options(ctx))
            return
        plan = prepare(config, planning=True)
        estimates = fit.estimate_plan(plan)
        limit = fit.gpu_limit_gib(plan.config, planning=True)
        summary = describe(plan, estimates, limit)
        try:
            fit.check(plan, estimates, planning=True)
        except UsageError:
            summary["valid"] = False
            print_plan(summary, as_json)
            raise
        print_plan(summary, as_json)
    except UsageError as err:
        raise fail(str(err)) from None


app.command("plan", cls=WholeNamesCommand)(with_options(_plan, [
    CONTEXT,
    inspect.Parameter("as_json", inspect.Parameter.KEYWORD_ONLY, default=False,
                      annotation=Annotated[bool, typer.Option("--json", help="machine-readable output")]),
    inspect.Parameter("suggest", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[
        bool, typer.Option("--suggest", help="list the valid layouts of --gpus N GPUs that fit --gpu-memory "
                                             "(default: the visible GPU, else the GPU the times are estimated "
                                             "for), most tokens/s/GPU first, and the first one's mimo run "
                                             "command")]),
    inspect.Parameter("gpus", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        typing.Optional[int], typer.Option("--gpus", help="with --suggest: the number of GPUs to lay out")]),
] + provider_parameters() + loop_parameters()))


def main():  # pragma: no cover - console entry point
    from mimo.core.run.peer_loss import lost_peer_line

    try:
        code = app()
    except Exception as err:  # a spawned worker whose peers stopped first: one line, not a traceback
        line = lost_peer_line(err)
        if line is None:
            raise
        print(line, file=sys.stderr)
        code = 1
    sys.exit(code)
