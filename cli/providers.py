"""`mimo providers list|show`: what is installed, from which distribution, and each provider's settings."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from mimo.errors import UsageError

from .help import PlainFlagsCommand, PlainFlagsGroup

WIDE_TABLE = 140  # columns from which `providers show` is one table

providers_app = typer.Typer(cls=PlainFlagsGroup, no_args_is_help=True,
                            help="Installed model providers and their settings.")


def _registry():
    from mimo.plugins import Registry

    return Registry()


@providers_app.command("list", cls=PlainFlagsCommand)
def list_providers(as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Installed providers, the distribution of each, and plugins that failed to load."""
    registry = _registry()
    rows = [
        {"name": name, "description": provider.description, "distribution": plugin.distribution,
         "entry_point": plugin.name, "conflict": len(claims) > 1}
        for name, claims in sorted(registry.providers.items()) for provider, plugin in claims
    ]
    broken = [{"entry_point": p.name, "distribution": p.distribution, "error": p.error} for p in registry.broken]
    if as_json:
        typer.echo(json.dumps({"providers": rows, "broken": broken}, indent=2))
        return
    console = Console()
    table = Table(title="Providers")
    table.add_column("provider", no_wrap=True)  # typed back as --provider NAME: never cut
    table.add_column("description", overflow="fold", ratio=1)
    table.add_column("distribution", no_wrap=True)
    for row in rows:
        note = " [red](name conflict)[/red]" if row["conflict"] else ""
        table.add_row(row["name"] + note, row["description"], row["distribution"])
    console.print(table)
    if broken:
        problems = Table("entry point", "distribution", "error", title="Plugins that failed to load")
        for row in broken:
            problems.add_row(row["entry_point"], row["distribution"], row["error"])
        console.print(problems)


@providers_app.command("show", cls=PlainFlagsCommand)
def show_provider(name: str, as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """A provider's settings with their types, defaults, rules and help (set them with `mimo run --set key=value`)."""
    from mimo.plugins.constraints import describe
    from mimo.plugins.settings import describe_fields

    from .common import fail

    try:
        provider, plugin = _registry().get(name)
    except UsageError as err:
        raise fail(str(err)) from None
    try:
        fields = describe_fields(provider.settings, dict(provider.defaults))
    except UsageError as err:  # a rule the provider declares wrongly
        raise fail(str(err)) from None
    if as_json:
        typer.echo(json.dumps({"name": provider.name, "description": provider.description,
                               "distribution": plugin.distribution, "settings": fields}, indent=2, default=str))
        return
    console = Console(highlight=False)
    if console.width >= WIDE_TABLE:
        # Names are never cut (they are typed back as --set NAME=...): the other columns wrap around them.
        table = Table(title=f"{provider.name}: {provider.description}")
        table.add_column("setting", no_wrap=True)
        for column in ("type", "default", "rules"):
            table.add_column(column, overflow="fold")
        table.add_column("help", overflow="fold", ratio=1)
        for f in fields:
            table.add_row(f["name"], f["type"], repr(f["default"]), describe(f["rules"]), f["help"])
        console.print(table)
        return
    # A narrow terminal: each setting's name, type and default on a line, its rules and help wrapped under it.
    console.print(Text(f"{provider.name}: {provider.description}", style="bold"))
    for f in fields:
        head = Text(f["name"], style="bold cyan")
        head.append(f"  {f['type']}, default {f['default']!r}", style="yellow")
        console.print(Padding(head, (1, 0, 0, 2)), crop=False, overflow="ignore")
        notes = "; ".join(filter(None, [f["help"], describe(f["rules"])]))
        if notes:
            console.print(Padding(Text(notes), (0, 0, 0, 6)))


def _register_new() -> None:
    """`mimo providers new`: the scaffold lives in scaffold.py with its templates."""
    from .scaffold import new_provider

    providers_app.command("new", cls=PlainFlagsCommand)(new_provider)


_register_new()
