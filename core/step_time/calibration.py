"""The step-time calibration: the rates the estimate (model.py) prices its terms with, read from calibration.json.

Every number there names the records it was fitted from and how (scripts/fit_step_time.py refits them from the
records and `--check` says whether the file still holds what they give). Times are for the calibration's GPU
(`reference_gpu`, with `reference_gpu_memory_gib` of memory); `gpu_speed` holds other GPUs' measured speed
relative to it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

FILE = Path(__file__).with_name("calibration.json")
KINDS = ("encoder", "language")  # the module kinds `model_flops` separates: encoders and the LLM


@dataclass(frozen=True)
class Calibration:
    reference_gpu: str
    peak_flops: float  # dense bf16 FLOP/s of the reference GPU
    efficiency: dict  # module kind -> fraction of peak its forward and backward reach
    collective_bytes_per_s: float  # what each GPU sends per second in NCCL collectives (all-reduce, TP)
    all_to_all_bytes_per_s: float  # what each GPU sends per second in the experts' all-to-all
    optimizer_s_per_parameter: float  # Adam's step per parameter the rank steps
    encoder_pass_overhead_s: float  # each encoder pass of a step beyond the first
    split_stage_overhead_s: float  # each LLM micro-batch of a heterogeneous layout (bridge send/receive)
    bridge_s: float  # each micro-batch the split's pipeline loses at the bridge beyond its stages' busy time
    reference_gpu_gib: float | None = None  # the reference GPU's memory: what --suggest fits into by default

    def seconds_per_flop(self, kind: str) -> float:
        return 1.0 / (self.peak_flops * self.efficiency[kind])


def values(document: dict) -> Calibration:
    """The Calibration of a calibration.json document."""
    fitted = {name: entry["value"] for name, entry in document["fitted"].items()}
    return Calibration(
        reference_gpu=document["reference_gpu"], peak_flops=document["peak_tflops"]["value"] * 1e12,
        efficiency={kind: fitted[f"efficiency_{kind}"] for kind in KINDS},
        collective_bytes_per_s=fitted["collective_gb_per_s"] * 1e9,
        all_to_all_bytes_per_s=fitted["all_to_all_gb_per_s"] * 1e9,
        optimizer_s_per_parameter=fitted["optimizer_ms_per_billion_parameters"] * 1e-3 / 1e9,
        encoder_pass_overhead_s=fitted["encoder_pass_overhead_ms"] * 1e-3,
        split_stage_overhead_s=fitted["split_stage_overhead_ms"] * 1e-3,
        bridge_s=fitted["bridge_ms"] * 1e-3,
        reference_gpu_gib=document.get("reference_gpu_memory_gib", {}).get("value"))


def read(path: Path = FILE) -> dict:
    return json.loads(path.read_text())


@functools.cache
def load() -> Calibration:
    """The calibration shipped with mimo."""
    return values(read())
