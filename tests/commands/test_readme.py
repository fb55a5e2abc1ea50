"""The README's "Using it" block, run as written, top to bottom, as a new user would after the setup line: every
command succeeds, nothing reaches stderr, and the console carries mimo's lines only (no library warning)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from helpers import REPO
from test_first_contact import FOREIGN, RUN_LINE

TRAINING = re.compile(r"^mimo (run|eval) (?!.*(--help|--print-config))")


def readme_commands() -> list[str]:
    """The commands of the first bash block under "## Using it", continuation lines joined, comments dropped."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Using it", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands, current = [], ""
    for line in block.splitlines():
        code = re.sub(r"\s+#.*$", "", line).rstrip() if not line.lstrip().startswith("#") else ""
        if code.endswith("\\"):
            current += code[:-1] + " "
            continue
        current += code
        if current.strip():
            commands.append(current.strip())
        current = ""
    return commands


def test_readme_block_runs_as_written(tmp_path):
    commands = readme_commands()
    assert commands[0] == "source .venv/bin/activate"
    venv_bin = Path(sys.executable).parent
    assert (venv_bin / "activate").is_file() and (venv_bin / "mimo").is_file()
    (tmp_path / ".venv").symlink_to(venv_bin.parent)  # the repository root as the README's commands see it
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("COLUMNS", None)
    for command in commands[1:]:
        assert command.startswith("mimo "), command
        result = subprocess.run(["bash", "-c", f"source .venv/bin/activate && {command}"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, (command, result.stderr[-3000:])
        assert result.stderr == "", (command, result.stderr[-3000:])
        assert not FOREIGN.search(result.stdout), (command, FOREIGN.search(result.stdout).group(0))
        if TRAINING.match(command):
            stray = [line for line in result.stdout.splitlines() if not RUN_LINE.match(line)]
            assert not stray, (command, stray)
    assert (tmp_path / "runs" / "a" / "iter_0000150").is_dir()
    assert (tmp_path / "runs" / "eval.json").is_file() and (tmp_path / "runs" / "my-vlm").is_dir()
