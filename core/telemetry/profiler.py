"""`--profile-dir`: torch.profiler over a few iterations, a Chrome trace per rank, and where device time went.

The summary splits the window's device (GPU) time by kernel kind and sets it against the wall time, so a run shows
whether it is bound by matrix multiplies, attention, element-wise kernels, communication or the host (the GPU idle).
On the CPU it ranks operators by CPU time instead.
"""

from __future__ import annotations

import bisect
import json
import re
import time
from pathlib import Path

import torch

from .launch_sites import launch_sites
from .sync_sites import SyncSites

from mimo.wording import counted

# First match wins: kernel names of cuBLAS/CUTLASS GEMMs, fused attention, NCCL, Adam, copies.
KINDS = [
    ("attention", re.compile(r"flash|fmha|attention|sdpa|scaled_dot_product", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|matmul|cublas|wgmma|sm90_|aten::(mm|addmm|bmm|baddbmm)$", re.I)),
    ("communication", re.compile(r"nccl", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|cat_|transpose", re.I)),
]


def kind_of(kernel_name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(kernel_name)), "elementwise/other")


class StepProfiler:
    """Profiles iterations [start, end] of this rank; a no-op without a directory."""

    def __init__(self, options, *, rank: int, device: torch.device, report: bool):
        """`options`: the run's LoggingOptions (--profile-dir, --profile-step-start/end); `report`: this rank
        prints where the time went."""
        directory, start, end = options.profile_dir, options.profile_step_start, options.profile_step_end
        self.directory, self.start, self.end, self.rank = directory, start, end, rank
        self.with_stack = options.profile_with_stack
        self.device, self.report = device, report
        self._profiler = None

    def before(self, iteration: int) -> None:
        if self.directory is None or iteration != self.start:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._synchronize()
        self._profiler = profile(activities=activities, with_stack=self.with_stack)
        self._profiler.__enter__()
        self._syncs = SyncSites().__enter__() if self.device.type == "cuda" else None
        self._wall = time.perf_counter()

    def after(self, iteration: int) -> None:
        if self._profiler is None or iteration != self.end:
            return
        self._synchronize()
        wall_ms = (time.perf_counter() - self._wall) * 1000
        if self._syncs is not None:
            self._syncs.__exit__(None, None, None)
        self._profiler.__exit__(None, None, None)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._profiler.export_chrome_trace(str(self.directory / f"trace_rank{self.rank}.json"))
        summary = summarize(self._profiler, wall_ms, self.end - self.start + 1, self.device)
        if self._syncs is not None:  # where the host waited for the GPU, by call site
            summary["host_syncs"] = self._syncs.top(self.end - self.start + 1)
        (self.directory / f"summary_rank{self.rank}.json").write_text(json.dumps(summary, indent=1))
        if self.report:
            print(format_summary(summary, self.directory), flush=True)
        self._profiler = None

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


TOP_KERNELS = 40  # the summary's busiest kernels: enough to account for most of an iteration's GPU time
SITED_KERNELS = 15  # the busiest of them with the places that launched them


def summarize(profiler, wall_ms: float, iterations: int, device: torch.device) -> dict:
    """Per-iteration milliseconds by kernel kind, the busiest kernels, and the device's idle share."""
    on_gpu = device.type == "cuda"
    by_kind: dict[str, float] = {}
    top = []
    entries = [e for e in profiler.key_averages() if not getattr(e, "is_user_annotation", False)]
    kernels = [e for e in entries if e.device_type == torch.autograd.DeviceType.CUDA]
    for entry in kernels or entries:  # kernels by name; else the operators that launched them
        if on_gpu:
            ms = entry.self_device_time_total / 1000
        else:
            ms = entry.self_cpu_time_total / 1000
        if ms <= 0 or entry.key.startswith("mimo/"):  # the loop's phase labels, not work
            continue
        kind = kind_of(entry.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + ms / iterations
        top.append((ms / iterations, entry.key))
    busy = sum(by_kind.values())
    per_iteration = wall_ms / iterations
    host = sorted(((e.self_cpu_time_total / 1000 / iterations, e.key) for e in entries
                   if e.device_type == torch.autograd.DeviceType.CPU), reverse=True)[:10]
    top = sorted(top, reverse=True)[:TOP_KERNELS]
    sites = launch_sites(profiler.events(), on_gpu=on_gpu, iterations=iterations,
                         kernels=[name for _, name in top[:SITED_KERNELS]])
    return {
        "iterations": iterations,
        "wall_ms_per_iteration": per_iteration,
        "device": "cuda" if on_gpu else "cpu",
        "busy_ms_per_iteration": busy,
        "idle_fraction": max(0.0, 1 - busy / per_iteration) if on_gpu else None,
        "ms_per_iteration_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top": [{"ms_per_iteration": ms, "name": name[:160], **({"sites": sites[name]} if name in sites else {})}
                for ms, name in top],
        "host_top": [{"ms_per_iteration": ms, "name": name[:160]} for ms, name in host],
        **(idle_report(profiler.events(), iterations) if on_gpu else {}),
    }


def idle_report(events, iterations: int) -> dict:
    """Where the GPU waits: idle time by loop phase, by gap length, and the longest gaps with the host operation
    each thread was in at their middle (the innermost one)."""
    kernels, phases, host = [], [], []
    for e in events:
        interval = (e.time_range.start, e.time_range.end)
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if not e.is_user_annotation:  # the GPU-side copies of record_function ranges are not kernels
                kernels.append(interval)
        elif e.name.startswith("mimo/"):
            phases.append((*interval, e.name))
        else:
            host.append((*interval, e.name, e.thread))
    gaps = idle_gaps(kernels, phases)
    # the loop's thread: the one that labels the phases
    host_main = next((e.thread for e in events if e.name.startswith("mimo/")), None)
    sizes = {"under 0.1 ms": 0.0, "0.1-1 ms": 0.0, "over 1 ms": 0.0}
    for start, end in gaps:
        ms = (end - start) / 1000
        sizes["under 0.1 ms" if ms < 0.1 else "0.1-1 ms" if ms < 1 else "over 1 ms"] += ms / iterations
    longest, by_operation = [], {}
    main = sorted((h[0], h[1], h[2]) for h in host if h[3] == host_main)
    starts = [h[0] for h in main]
    for start, end in sorted(gaps, key=lambda g: g[0] - g[1]):
        middle = (start + end) / 2
        if len(longest) < 8:
            innermost: dict[int, tuple] = {}  # per host thread, the shortest operation running at the middle
            for h in host:
                shorter = h[3] not in innermost or h[1] - h[0] < innermost[h[3]][1] - innermost[h[3]][0]
                if h[0] <= middle <= h[1] and shorter:
                    innermost[h[3]] = h
            longest.append({"ms": (end - start) / 1000, "phase": _phase_at(phases, middle),
                            "host": sorted({h[2] for h in innermost.values()})})
        if end - start >= 100:  # gaps of 0.1 ms and more: what the loop's thread was in while the GPU waited
            name = f"{_phase_at(phases, middle)} | {_innermost(main, starts, middle)}"
            by_operation[name] = by_operation.get(name, 0.0) + (end - start) / 1000 / iterations
    return {"idle_ms_per_iteration_by_phase": idle_by_phase(kernels, phases, iterations),
            "idle_ms_per_iteration_by_gap": sizes, "longest_idle_gaps": longest,
            "idle_ms_per_iteration_by_host_operation": dict(sorted(by_operation.items(), key=lambda kv: -kv[1])[:15])}


def _innermost(events: list[tuple], starts: list[float], moment: float, reach: int = 5000) -> str:
    """The innermost operation of one thread (its events sorted by start, properly nested) running at `moment`:
    the latest-started one that has not ended; "(python)" when none of the last `reach` has."""
    i = bisect.bisect_right(starts, moment)
    for j in range(i - 1, max(-1, i - 1 - reach), -1):
        if events[j][1] >= moment:
            return events[j][2]
    return "(python)"


def idle_gaps(kernels: list[tuple], phases: list[tuple]) -> list[tuple]:
    """Intervals inside the labelled window (first to last phase) where no kernel runs."""
    if not kernels or not phases:
        return []
    window_start, window_end = min(p[0] for p in phases), max(p[1] for p in phases)
    gaps, cursor = [], window_start
    for start, end in sorted(kernels):
        if start > cursor:
            gaps.append((cursor, min(start, window_end)))
        cursor = max(cursor, end)
    if cursor < window_end:
        gaps.append((cursor, window_end))
    return [(a, b) for a, b in gaps if b > a]


def _phase_at(phases: list[tuple], moment: float) -> str:
    around = [p for p in phases if p[0] <= moment <= p[1]]
    return min(around, key=lambda p: p[1] - p[0])[2] if around else "other"


def idle_by_phase(kernels: list[tuple], phases: list[tuple], iterations: int) -> dict[str, float]:
    """GPU idle milliseconds per iteration inside the labelled window, attributed to the innermost `mimo/...` phase
    the host was in at the middle of each idle gap (the loop labels its phases with record_function); "other" is
    idle time outside every labelled phase."""
    totals: dict[str, float] = {}
    for start, end in idle_gaps(kernels, phases):
        name = _phase_at(phases, (start + end) / 2)
        totals[name] = totals.get(name, 0.0) + (end - start) / 1000 / iterations
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def format_summary(summary: dict, directory: Path) -> str:
    per_iteration = summary["wall_ms_per_iteration"]
    lines = [f"profile ({counted(summary['iterations'], 'iteration')}, trace in {directory}): {per_iteration:.1f} "
             f"ms/iteration"]
    if summary["idle_fraction"] is not None:
        lines[0] += f", GPU busy {summary['busy_ms_per_iteration']:.1f} ms ({1 - summary['idle_fraction']:.0%})"
    for kind, ms in summary["ms_per_iteration_by_kind"].items():
        lines.append(f"  {kind:<18} {ms:9.1f} ms  {ms / per_iteration:6.1%} of wall time")
    for phase, ms in (summary.get("idle_ms_per_iteration_by_phase") or {}).items():
        lines.append(f"  GPU idle in {phase:<18} {ms:7.1f} ms")
    for size, ms in (summary.get("idle_ms_per_iteration_by_gap") or {}).items():
        lines.append(f"  GPU idle in gaps {size:<13} {ms:7.1f} ms")
    for where, ms in list((summary.get("idle_ms_per_iteration_by_host_operation") or {}).items())[:6]:
        lines.append(f"  GPU idle while the loop ran {where}: {ms:.1f} ms")
    for entry in summary["top"][:5]:
        where = f" <- {entry['sites'][0]['site']}" if entry.get("sites") else ""
        lines.append(f"  {entry['ms_per_iteration']:7.1f} ms  {entry['name'][:70]}{where}")
    for sync in (summary.get("host_syncs") or [])[:6]:
        lines.append(f"  host waits for the GPU {sync['per_iteration']:g} times per iteration at {sync['site']}")
    return "\n".join(lines)
