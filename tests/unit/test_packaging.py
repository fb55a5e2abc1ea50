"""The wheel `pip install .` builds holds every package of the source tree under its `mimo.*` name; the set-up that
installs it says nothing but errors."""

import subprocess
import sys
import zipfile

from helpers import REPO

SOURCE_PACKAGES = ("cli", "core", "plugins", "providers", "testing")


def test_wheel_contains_every_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(REPO)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("mimo-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"mimo/{p.relative_to(REPO)}" for top in SOURCE_PACKAGES for p in (REPO / top).rglob("*.py")}
    expected |= {"mimo/__init__.py", "mimo/errors.py"}
    assert expected <= names, f"missing from the wheel (add them to pyproject's packages): {sorted(expected - names)}"
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "[mimo.providers]" in entry_points and "mock-vlm = mimo.providers.mock_vlm" in entry_points


def test_setup_filters_the_harmless_pip_warning_from_every_pip_call():
    """The first setup printed pip's upgrade's 'WARNING: Location ... is ignored' (a machine's local index
    folders), its only line: every pip install in scripts/setup.sh goes through `quiet`."""
    calls = [line for line in (REPO / "scripts" / "setup.sh").read_text().splitlines()
             if "-m pip install" in line]
    assert calls and all(line.rstrip().endswith("2>&1 | quiet") for line in calls), calls
