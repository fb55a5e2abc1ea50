"""Following the README does not litter the repository: the provider package its `mimo providers new` writes goes
where git ignores it, as every other file its block writes (runs/)."""

from __future__ import annotations

import shlex
import subprocess

from helpers import REPO
from test_readme import readme_commands


def test_readme_scaffold_writes_where_git_ignores_it():
    [command] = [c for c in readme_commands() if c.startswith("mimo providers new ")]
    words = [w for w in shlex.split(command)[3:] if not w.startswith("-")]
    destination = words[1] if len(words) > 1 else words[0]  # the folder argument, else ./NAME
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{destination}/pyproject.toml"], cwd=REPO)
    assert ignored.returncode == 0, f"`{command}` writes {destination}/ into the repository"
