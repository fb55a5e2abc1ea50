"""`mimo plan` fits the terminal (COLUMNS=80 here): its tables wrap between words, turn (a row per column) or stack,
and never cut a name; colocated and heterogeneous layouts and `--suggest` alike."""

from __future__ import annotations

import json
import re

import pytest

from helpers import run_mimo

NARROW = {"COLUMNS": "80"}
HEADERS = ["module", "ranks", "layers", "parameters", "per", "rank", "(≈)", "params", "grads", "optimizer",
           "activations", "allowance", "total", "limit", "headroom"]


def words(output: str) -> set[str]:
    return set(re.split(r"[\s│┃┏┓┗┛┡┩┣┫━─┳┻╇┼└┘┌┐├┤┬┴]+", output))


def assert_fits(output: str, width: int = 80) -> None:
    too_wide = [line for line in output.splitlines() if len(line) > width]
    assert not too_wide, too_wide
    assert "…" not in output  # rich's mark of a cut cell


@pytest.mark.parametrize("layout", [["--nproc-per-node", "2"], ["--nproc-per-node", "4", "--encoder-ranks", "1"]])
def test_plan_tables_fit_80_columns(layout):
    result = run_mimo("plan", "--provider", "mock-vlm", *layout, env=NARROW)
    assert result.returncode == 0, result.stderr
    assert_fits(result.stdout)
    shown = words(result.stdout)
    missing = [name for name in HEADERS + ["images", "language", "121,792", "133,376"] if name not in shown]
    assert not missing, (missing, result.stdout)


def test_suggestions_fit_80_columns():
    args = ("plan", "--provider", "mock-vlm", "--suggest", "--gpus", "4")
    result = run_mimo(*args, env=NARROW)
    assert result.returncode == 0, result.stderr
    assert_fits(result.stdout)
    layouts = json.loads(run_mimo(*args, "--json").stdout)["layouts"]
    options = {option for layout in layouts for option in layout["options"]}
    lines = result.stdout.splitlines()
    # each option whole on one line, where it can be copied from
    assert options and all(any(option in line for line in lines) for option in options), options
