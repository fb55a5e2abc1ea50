"""`--help` for commands with many options (run, eval, plan): grouped by component like typer's panels, but the
option names are never cut. typer's rich tables share the width among names, types and help, so at 80 columns
they cut long names (`--use-distributed-o…`) that then cannot be copied; here the help text wraps instead, and
where the terminal is too narrow for names and help side by side, the help goes under the names."""

from __future__ import annotations

from collections import defaultdict

import typer.core
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

MIN_HELP_WIDTH = 36  # narrower than this, the help goes under the option's names
INDENT = 6


def _names(param) -> Text:
    lines = [", ".join(param.opts)] + ([", ".join(param.secondary_opts)] if param.secondary_opts else [])
    return Text("\n".join(lines), style="bold cyan")


def _kind(param, ctx) -> Text:
    if getattr(param, "is_flag", False):
        return Text("")
    shown = param.display_type_rich(ctx) if hasattr(param, "display_type_rich") else param.make_metavar(ctx)
    return Text(shown or "", style="yellow")


def _help(param, ctx) -> Text:
    record = param.get_help_record(ctx)  # (names, help with its [default: ...]), as click prints them
    text = Text(" ".join((record[1] if record else "").split()))
    if param.required and not text.plain.endswith("[required]"):  # an argument's record says it already
        text.append(" [required]", style="red")
    return text


class WholeNamesCommand(typer.core.TyperCommand):
    """A typer command whose help never cuts an option's name."""

    def format_help(self, ctx, formatter) -> None:
        console = Console(highlight=False)
        console.print(Padding(Text(self.get_usage(ctx), style="bold"), (1, 1, 0, 1)))
        if self.help:
            paragraphs = [" ".join(part.split()) for part in self.help.split("\f")[0].split("\n\n")]
            console.print(Padding(Text("\n\n".join(p for p in paragraphs if p)), (1, 1, 0, 1)))
        panels: dict[str, list] = defaultdict(list)
        for param in self.get_params(ctx):
            if not getattr(param, "hidden", False):
                panels[getattr(param, "rich_help_panel", None) or "Options"].append(param)
        for title, params in panels.items():
            console.print(Padding(Text(title, style="bold"), (1, 1, 0, 1)))
            rows = [(_names(p), _kind(p, ctx), _help(p, ctx)) for p in params]
            name_width = max(max(len(line) for line in n.plain.split("\n")) for n, _, _ in rows)
            kind_width = max(len(k.plain) for _, k, _ in rows)
            if console.width - name_width - kind_width - 6 >= MIN_HELP_WIDTH:
                table = Table(box=None, show_header=False, padding=(0, 1), pad_edge=False)
                table.add_column(no_wrap=True, min_width=name_width)
                table.add_column(no_wrap=True)
                table.add_column(overflow="fold", ratio=1)
                for row in rows:
                    table.add_row(*row)
                console.print(Padding(table, (0, 1, 0, 2)))
            else:  # names (and type) on their own lines, the help under them
                for names, kind, text in rows:
                    head = names.copy()
                    if kind.plain:
                        head.append(" ")
                        head.append_text(kind)
                    console.print(Padding(head, (0, 1, 0, 2)), overflow="ignore", crop=False)
                    if text.plain:
                        console.print(Padding(text, (0, 1, 0, INDENT)))


def _plain_flags(params: list) -> list:
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""  # typer's help shows a flag's type (`--help <bool>`) as if it took a value
    return params


class PlainFlagsCommand(typer.core.TyperCommand):
    """A typer command whose help lists flags (--help, --json, ...) as flags, with no type."""

    def get_params(self, ctx):
        return _plain_flags(super().get_params(ctx))


class PlainFlagsGroup(typer.core.TyperGroup):
    """A typer group whose help lists flags as flags, as PlainFlagsCommand does."""

    def get_params(self, ctx):
        return _plain_flags(super().get_params(ctx))
