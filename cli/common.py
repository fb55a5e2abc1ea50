"""What every `mimo` subcommand shares: the one-line usage error and quiet megatron-core import notices.

Its own module so the subcommands (ckpt, data, providers, scaffold) need not import `cli/main.py`, which
imports them to register their commands.
"""

from __future__ import annotations

import logging
import warnings

import typer


def fail(message: str) -> typer.Exit:
    """Print one line naming the problem and exit 2."""
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(code=2)


def quiet_import_notices() -> None:
    """megatron-core announces missing optional kernels and experimental APIs on every import and build; on a
    run they would bury the log. Real warnings still show."""
    for message in (".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*", ".*is experimental.*",
                    ".*full scope is deprecated.*", ".*an autograd kernel was not registered.*",
                    ".*deprecating ShardedTensor.*", ".*argument order of load has been changed.*",
                    ".*torch.distributed is disabled, unavailable or uninitialized.*",
                    # mimo sets each rank's GPU (torch.cuda.set_device) before its first collective
                    ".*barrier\\(\\): using the device under current context.*"):
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # mimo writes common.pt for Megatron's tools; megatron-core then notes it reads the "legacy" file.
    logging.getLogger("megatron.core.dist_checkpointing.strategies.common").setLevel(logging.ERROR)
    logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").setLevel(logging.ERROR)
