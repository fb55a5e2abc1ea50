"""The `mimo` command."""

from __future__ import annotations

import inspect
import sys
import typing
from pathlib import Path
from typing import Annotated

import typer

from mimo.errors import TrainingStopped, UsageError

from .common import fail, quiet_import_notices
from .options import loop_parameters, provider_parameters, run_config, with_options
from .ckpt import ckpt_app
from .data import data_app
from .providers import providers_app

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Train multimodal models on megatron-core; model families come as provider plugins.")
app.add_typer(providers_app, name="providers")
app.add_typer(ckpt_app, name="ckpt")
app.add_typer(data_app, name="data")


def _run(**kwargs):
    """Train a provider's model. Loop options only; the model's own settings go through --set/--provider-config."""
    quiet_import_notices()
    from mimo.core.run import launch, preflight
    from mimo.core.run.loop import train

    launch.die_with_launcher()
    try:
        with preflight.for_run(run_config(kwargs)) as plan:
            if launch.needs_launcher(plan.config.launch):
                raise typer.Exit(code=launch.start_workers(plan.config.launch, sys.argv[1:]))
            train(plan)
    except UsageError as err:
        raise fail(str(err)) from None
    except TrainingStopped as err:
        if not getattr(err, "quiet", False):  # a stop on a signal: one rank says it for the run
            typer.secho(f"error: {err}", err=True, fg=typer.colors.RED)
        raise typer.Exit(code=1) from None


app.command("run", context_settings={"max_content_width": 120})(
    with_options(_run, provider_parameters() + loop_parameters())
)


def _eval(split: str = "val", json_path=None, **kwargs):
    """Evaluate a checkpoint without training: its held-out loss on --data's val (or test) split, or the
    provider's synthetic eval data, over --eval-iters global batches (default 10), in any layout that fits."""
    quiet_import_notices()
    from mimo.core.evaluation.standalone import evaluate_checkpoint
    from mimo.core.run import launch, preflight

    launch.die_with_launcher()
    try:
        with preflight.for_eval(run_config(kwargs), split) as plan:
            if launch.needs_launcher(plan.config.launch):
                raise typer.Exit(code=launch.start_workers(plan.config.launch, sys.argv[1:]))
            evaluate_checkpoint(plan, split, json_path)
    except UsageError as err:
        raise fail(str(err)) from None


app.command("eval", context_settings={"max_content_width": 120})(with_options(_eval, [
    inspect.Parameter("split", inspect.Parameter.KEYWORD_ONLY, default="val", annotation=Annotated[
        str, typer.Option("--split", help="which split of --data to evaluate: val or test")]),
    inspect.Parameter("json_path", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        typing.Optional[Path], typer.Option("--json", help="write the figures to this JSON file")]),
] + provider_parameters() + loop_parameters()))


def _plan(as_json: bool = False, suggest: bool = False, gpus: typing.Optional[int] = None, **kwargs):
    """Show which ranks run which module with which TP/DP/PP/EP, parameter counts, the memory estimate per GPU,
    and whether the layout is valid and fits (exit 2 if not), for the same options as `mimo run`, without
    starting workers. With --suggest --gpus N: the layouts of N GPUs that fit, best first."""
    quiet_import_notices()
    from mimo.core.memory import fit
    from mimo.core.run.plan import prepare

    from .plan import describe, print_plan, print_suggestions

    try:
        if suggest or gpus is not None:
            if not (suggest and gpus):
                raise UsageError("--suggest and --gpus N go together (N >= 1): list the layouts of N GPUs that fit")
            print_suggestions(run_config(kwargs), gpus, as_json)
            return
        plan = prepare(run_config(kwargs))
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


app.command("plan", context_settings={"max_content_width": 120})(with_options(_plan, [
    inspect.Parameter("as_json", inspect.Parameter.KEYWORD_ONLY, default=False,
                      annotation=Annotated[bool, typer.Option("--json", help="machine-readable output")]),
    inspect.Parameter("suggest", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[
        bool, typer.Option("--suggest", help="list the valid layouts of --gpus N GPUs that fit --gpu-memory, "
                                             "best first")]),
    inspect.Parameter("gpus", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        typing.Optional[int], typer.Option("--gpus", help="with --suggest: the number of GPUs to lay out")]),
] + provider_parameters() + loop_parameters()))


def main():  # pragma: no cover - console entry point
    sys.exit(app())
