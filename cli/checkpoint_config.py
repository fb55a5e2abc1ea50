"""The RunConfig of a command that reads a checkpoint: `mimo eval` and `mimo generate` (the command line over what
the checkpoint says about its run, core/checkpoint/saved_run.py: its provider, so --provider may be left out, its
settings and the loop options that decide the figures; what the user typed, or wrote in a --config file, wins) and
`mimo run --load` resuming a mimo checkpoint (its provider and settings, which a --set may not change)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from mimo.core import run_file
from mimo.core.checkpoint.foreign import foreign_directory
from mimo.core.checkpoint.hf import is_hf_folder
from mimo.core.checkpoint.layout import read_tracker
from mimo.core.checkpoint.resume import require_checkpoint
from mimo.core.checkpoint.saved_run import (
    honour, recorded_base, refuse_changed_settings, report_lines, saved_run,
)
from mimo.core.config import RunConfig
from mimo.errors import UsageError

from .options import given_on_command_line, refuse_packing_without_data, run_config


def config_from_checkpoint(kwargs: dict, ctx, command: str) -> tuple[RunConfig, Callable | None]:
    """(the command's RunConfig, `report(plan) -> lines` saying what came from the checkpoint; None when the
    checkpoint records no run)."""
    weights = ("load", "pretrained", "pretrained_llm", "pretrained_vision")
    if not kwargs.get("provider") and not kwargs.get("config") and not any(kwargs.get(w) for w in weights):
        raise UsageError(f"mimo {command} needs --load CKPT (a mimo checkpoint) or --pretrained PATH (a mimo "
                         f"checkpoint or a Hugging Face folder)")
    if not kwargs.get("provider"):  # an empty folder is the problem to name, not the missing --provider
        if kwargs.get("load"):
            require_checkpoint(kwargs["load"])
        elif kwargs.get("pretrained") and Path(kwargs["pretrained"]).is_dir() \
                and not is_hf_folder(kwargs["pretrained"]):
            foreign_directory(kwargs["pretrained"])
    saved = saved_run(kwargs.get("load") or kwargs.get("pretrained"), kwargs.get("provider"))
    if saved is not None and not kwargs.get("provider"):
        kwargs = {**kwargs, "provider": saved.provider}
    config = run_config(kwargs, ctx, from_checkpoint=True)
    if saved is None:
        refuse_packing_without_data(config, ctx)
        return config, None
    given = _given(config, ctx)
    honoured = honour(config, saved, given, command)
    honoured, base = recorded_base(honoured, saved, given, command)
    refuse_packing_without_data(honoured, ctx)  # --data may be the checkpoint's run's
    return honoured, lambda plan: report_lines(plan, saved, config, honoured, command) + ([base] if base else [])


def config_for_run(kwargs: dict, ctx) -> tuple[RunConfig, list[str]]:
    """`mimo run`'s RunConfig, and the lines saying what it took from a checkpoint; resuming a mimo checkpoint
    (`--load` holding one), with its provider and settings: the run goes on as it was trained. Loop options stay
    the command line's (a resume may change them), but for a LoRA checkpoint's --lora-* options and its base,
    which the checkpoint records."""
    load = kwargs.get("load")
    saved = saved_run(load) if load and Path(load).is_dir() and read_tracker(load) is not None else None
    if saved is not None and not kwargs.get("provider"):
        kwargs = {**kwargs, "provider": saved.provider}
    config = run_config(kwargs, ctx)
    if saved is None:
        return config, []
    given = _given(config, ctx)
    honoured = honour(config, saved, given, "run")
    refuse_changed_settings(honoured, saved)
    honoured, base = recorded_base(honoured, saved, given, "run")
    if saved.adapter_base is None:
        return honoured, []
    taken = [f"{name}={getattr(honoured.adapters, name)}" for name in ("lora_rank", "lora_alpha", "lora_experts",
                                                                       "lora_targets")
             if getattr(honoured.adapters, name) != getattr(config.adapters, name)]
    lines = [f"mimo run: {', '.join(taken)} from {saved.source}"] if taken else []
    return honoured, lines + ([base] if base else [])


def _given(config: RunConfig, ctx) -> set[str]:
    """The options the user typed or wrote in the --config file: they win over the checkpoint's."""
    given = given_on_command_line(ctx)
    if config.config_file is not None:
        file_values = run_file.read(config.config_file)
        given |= {name for section in run_file.sections() for name in file_values.get(section, {})}
    return given
