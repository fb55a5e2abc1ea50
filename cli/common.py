"""What every `mimo` subcommand shares: the one-line usage error.

Its own module so the subcommands (ckpt, data, providers, scaffold) need not import `cli/main.py`, which
imports them to register their commands. What reaches the console otherwise is cli/console.py's.
"""

from __future__ import annotations

import typer


def fail(message: str) -> typer.Exit:
    """Print one line naming the problem (one per problem, when there are several) and exit 2."""
    typer.secho("\n".join(f"error: {line}" for line in message.splitlines() or [""]), err=True, fg=typer.colors.RED)
    return typer.Exit(code=2)
