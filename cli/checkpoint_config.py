"""The RunConfig of a command that reads a checkpoint (`mimo eval`, `mimo generate`): the command line over what
the checkpoint says about its run (core/checkpoint/saved_run.py): its provider (so --provider may be left out),
its settings and the loop options that decide the figures. What the user typed, or wrote in a --config file, wins."""

from __future__ import annotations

from typing import Callable

from mimo.core import run_file
from mimo.core.checkpoint.saved_run import honour, report_lines, saved_run
from mimo.core.config import RunConfig

from .options import _given_on_command_line, run_config


def config_from_checkpoint(kwargs: dict, ctx, command: str) -> tuple[RunConfig, Callable | None]:
    """(the command's RunConfig, `report(plan) -> lines` saying what came from the checkpoint; None when the
    checkpoint records no run)."""
    saved = saved_run(kwargs.get("load") or kwargs.get("pretrained"), kwargs.get("provider"))
    if saved is not None and not kwargs.get("provider"):
        kwargs = {**kwargs, "provider": saved.provider}
    config = run_config(kwargs, ctx)
    if saved is None:
        return config, None
    given = _given_on_command_line(ctx)
    if config.config_file is not None:
        file_values = run_file.read(config.config_file)
        given |= {name for section in run_file.sections() for name in file_values.get(section, {})}
    honoured = honour(config, saved, given, command)
    return honoured, lambda plan: report_lines(plan, saved, config, honoured, command)
