"""The Triton kernels this family autotunes (mamba-ssm's Mamba-2 scans, transformer-engine's token permutation)
and the choices recorded for them, one JSON table per GPU in kernel_configs/, as mimo's compile cache records them
(`kernel_configs.json`). A GPU run pins them instead of autotuning at its first iteration and records new choices
for these modules; a table is copied here from a run on that GPU at the family's widths."""

from __future__ import annotations

import json
from importlib import resources

# Modules whose autotuned kernels are pinned and recorded (each optional: skipped where the package is absent).
MODULES = (
    "mamba_ssm.ops.triton.ssd_bmm", "mamba_ssm.ops.triton.ssd_chunk_scan", "mamba_ssm.ops.triton.ssd_chunk_state",
    "mamba_ssm.ops.triton.ssd_combined", "mamba_ssm.ops.triton.ssd_state_passing",
    "transformer_engine.common.triton.permutation", "transformer_engine.common.triton.pad",
)


def recorded_tables() -> list[dict]:
    folder = resources.files(__package__) / "kernel_configs"
    if not folder.is_dir():
        return []
    return [json.loads(entry.read_text()) for entry in sorted(folder.iterdir(), key=lambda e: e.name)
            if entry.name.endswith(".json")]
