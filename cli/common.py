"""What every `mimo` subcommand shares: the one-line usage error, and starting a run's workers.

Its own module so the subcommands (ckpt, data, providers, scaffold) need not import `cli/main.py`, which
imports them to register their commands. What reaches the console otherwise is cli/console.py's.
"""

from __future__ import annotations

import sys

import typer


def fail(message: str) -> typer.Exit:
    """Print one line naming the problem (one per problem, when there are several) and exit 2."""
    typer.secho("\n".join(f"error: {line}" for line in message.splitlines() or [""]), err=True, fg=typer.colors.RED)
    return typer.Exit(code=2)


def start_workers(plan) -> int:
    """Start the run's workers on this node (mimo's launcher) with this command's arguments; their exit code.
    On CPU they are forked from this process once it has done worker_imports.py's imports."""
    from mimo.core.run import launch

    return launch.start_workers(plan.config.launch, sys.argv[1:], plan.config.training.device,
                                ["mimo.cli.worker_imports"])
