"""Run the worker (build, forward/backward, checkpoint round trip) in a fresh interpreter and read its verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .report import ContractError
from .worker import RESULT_MARK

# A model above this many parameters is not built on CPU by the checks (the static checks still run).
CPU_PARAMETER_LIMIT = 200_000_000


def too_large(shapes: dict, limit: int = CPU_PARAMETER_LIMIT) -> str | None:
    """Why the model is not built on CPU, or None. Counts only what model_shape reports."""
    total = sum(s.num_parameters or 0 for s in shapes.values())
    if total > limit:
        return (f"not built on CPU: model_shape reports {total:,} parameters, above the checks' limit of {limit:,} "
                f"(check a small variant or pass small settings)")
    return None


def check_build_and_train(name: str, assignments=(), workdir: Path | None = None, timeout: int = 600) -> dict:
    """Build provider `name` on CPU with mimo's machinery, train it 2 iterations and round-trip a checkpoint, in
    a subprocess (the same environment, so the same installed providers). Returns the worker's numbers."""
    with tempfile.TemporaryDirectory(prefix="mimo-contract-") as scratch:
        directory = Path(workdir or scratch)
        command = [sys.executable, "-m", "mimo.testing.worker", "--provider", name, "--workdir", str(directory)]
        command += [arg for a in assignments for arg in ("--set", a)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
        except subprocess.TimeoutExpired:
            raise ContractError("build", f"building and training '{name}' for 2 iterations on CPU took over "
                                         f"{timeout} s; check it with smaller settings") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if not lines:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise ContractError("build", f"the contract worker died (exit {done.returncode}) without a verdict: {tail}")
    result = json.loads(lines[-1][len(RESULT_MARK):])
    if not result["ok"]:
        hook, _, rule = result["error"].partition(": ")
        raise ContractError(hook, rule)
    return result
