"""`mimo providers new`: names and directories are checked with one line; the package it writes installs with pip,
is listed, trains through `mimo run`, and its own generated tests (mimo.testing's contract) pass."""

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

from helpers import REPO, install_distribution, read_metrics, run_mimo
from mimo.cli.scaffold import TEMPLATES, check_directory, check_name, check_not_installed, scaffold
from mimo.errors import UsageError

NAME = "scaffold-check-vlm"


@pytest.mark.parametrize("name, message", [
    ("My-VLM", "use lowercase letters, digits and single hyphens"),
    ("9lives", "starting with a letter"),
    ("two--hyphens", "single hyphens"),
    ("class", "is a Python keyword or standard-library module"),
    ("json", "is a Python keyword or standard-library module"),
    ("torch", "a module 'torch' is already importable here"),
])
def test_invalid_names_are_refused(name, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        check_name(name)


def test_an_installed_provider_name_is_refused():
    with pytest.raises(UsageError, match=r"a provider named 'mock-vlm' is already installed \(from mimo "):
        check_not_installed(check_name("mock-vlm"))


def test_directory_must_be_new_or_empty(tmp_path):
    check_directory(tmp_path / "new")
    check_directory(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is not empty"):
        check_directory(tmp_path)
    with pytest.raises(UsageError, match="is not a directory"):
        check_directory(tmp_path / "file")


def test_cli_errors_are_one_line_and_exit_2(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "README").write_text("mine")
    for args in (("Bad Name",), (NAME, str(tmp_path / "taken"))):
        result = run_mimo("providers", "new", *args)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert result.stderr.startswith("error: ")
    assert list((tmp_path / "taken").iterdir()) == [tmp_path / "taken" / "README"]


def test_mimo_testing_and_every_template_ship_in_the_wheel():
    """setuptools ships data only from listed packages with matching package-data patterns."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "mimo.testing" in config["packages"]
    for template in TEMPLATES.rglob("*"):
        if template.is_file():
            package = "mimo." + ".".join(template.parent.relative_to(REPO).parts)
            assert package in config["packages"] and "*.tmpl" in config["package-data"].get(package, []), template
            assert template.suffix == ".tmpl", f"{template}: name templates *.tmpl so no tool runs them as code"


def test_scaffold_writes_the_package_layout(tmp_path):
    written = scaffold("layout-vlm", tmp_path / "pkg")
    assert sorted(str(p.relative_to(tmp_path / "pkg")) for p in written) == [
        "README.md", "layout_vlm/__init__.py", "layout_vlm/data.py", "layout_vlm/model.py", "pyproject.toml",
        "tests/test_contract.py"]
    pyproject = tomllib.loads((tmp_path / "pkg" / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["mimo.providers"] == {"layout-vlm": "layout_vlm"}
    assert "class LayoutVlmSettings" in (tmp_path / "pkg" / "layout_vlm" / "__init__.py").read_text()


def test_scaffolded_provider_installs_trains_and_passes_its_tests(tmp_path, tmp_target):
    package = tmp_path / NAME
    created = run_mimo("providers", "new", NAME, str(package))
    assert created.returncode == 0, created.stderr
    install_distribution(package, tmp_target)

    listing = run_mimo("providers", "list", "--json", extra_path=[tmp_target])
    row = next(r for r in json.loads(listing.stdout)["providers"] if r["name"] == NAME)
    assert row["distribution"] == f"{NAME} 0.1.0" and not row["conflict"]

    metrics = tmp_path / "m.jsonl"
    run = run_mimo("run", "--provider", NAME, "--train-iters", "5", "--log-interval", "1", "--device", "cpu",
                   "--metrics-file", str(metrics), extra_path=[tmp_target])
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [r["lm_loss"] for r in read_metrics(metrics)]
    assert len(losses) == 5 and losses[-1] < losses[0], losses

    # The generated tests, run as the package's author would, against the installed package.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_target), os.environ.get("PYTHONPATH", "")])}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"], cwd=package,
                           env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-4000:]
    passed = int(re.search(r"(\d+) passed", tests.stdout).group(1))
    assert passed >= 8 and " failed" not in tests.stdout, tests.stdout[-2000:]
