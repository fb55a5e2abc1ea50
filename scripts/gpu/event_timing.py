"""Milliseconds of GPU work by CUDA events, shared by the kernel checks in this folder (each run as
`python3 scripts/gpu/NAME.py`, so this module imports as a sibling)."""

from __future__ import annotations

import statistics

import torch


def spread_ms(body, runs: int = 20, warmup: int = 5) -> list[float]:
    """[min, median, max] milliseconds of `body()` over `runs` calls after `warmup` untimed ones, each call
    bracketed by CUDA events and waited for."""
    times = []
    for i in range(warmup + runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        body()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return [round(min(times), 3), round(statistics.median(times), 3), round(max(times), 3)]
