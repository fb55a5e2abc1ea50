"""Every command's and group's --help lists flags as flags: `--help`, `--json`, `--version` take no value, so no
type (`<bool>`) follows them. Walks every command of the `mimo` tree."""

from __future__ import annotations

import re

import typer.main
from typer.testing import CliRunner

from mimo.cli.main import app


def command_paths(command, path=()):
    yield list(path)
    for name, sub in (getattr(command, "commands", None) or {}).items():
        yield from command_paths(sub, (*path, name))


def test_every_help_lists_flags_without_a_type():
    paths = list(command_paths(typer.main.get_command(app)))
    assert ["providers", "new"] in paths and ["data", "convert", "llava"] in paths and ["run"] in paths
    runner = CliRunner()
    for path in paths:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "160"})
        assert result.exit_code == 0, (path, result.output)
        assert re.search(r"--help\b", result.output), (path, result.output)
        typed_flags = re.findall(r"--[\w-]+\s+<bool>", result.output)
        assert not typed_flags, (path, typed_flags)
