"""The Triton autotune choices recorded for this family's kernels (mamba-ssm's Mamba-2 scans, transformer-engine's
token permutation), one JSON table per GPU in kernel_configs/, as mimo's compile cache records them
(`kernel_configs.json`). A GPU run pins them instead of autotuning at its first iteration; a table is copied here
from a run on that GPU at the family's widths."""

from __future__ import annotations

import json
from importlib import resources


def recorded_tables() -> list[dict]:
    folder = resources.files(__package__) / "kernel_configs"
    if not folder.is_dir():
        return []
    return [json.loads(entry.read_text()) for entry in sorted(folder.iterdir(), key=lambda e: e.name)
            if entry.name.endswith(".json")]
