"""Where a decode step's time goes: torch.profiler (CPU and CUDA) over a few one-token steps of a generate call.

`profile_decode(name, generate, lm, steps, device, folder)` marks every forward of `lm` (the language model a
generate call drives once for the prompt, then once per new token), runs `generate(steps + 2)` under the profiler,
writes `<folder>/<name>.trace.json` (chrome://tracing, Perfetto) and returns a summary of the `steps` forwards after
the prompt's: a step runs from the start of one forward to the start of the next (choosing the token included).
Host time per step is that span; GPU busy time is the union of the kernels, copies and memsets launched in it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

MARK = "decode.forward"
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _marked(lm):
    """Forward hooks that open a profiler range at each forward of `lm` and close it after."""
    open_ranges = []

    def before(module, args, kwargs=None):
        open_ranges.append(torch.autograd.profiler.record_function(MARK).__enter__())

    def after(module, args, kwargs_or_output, output=None):
        open_ranges.pop().__exit__(None, None, None)

    return [lm.register_forward_pre_hook(before, with_kwargs=True), lm.register_forward_hook(after, with_kwargs=True)]


def profile_decode(name: str, generate, lm, steps: int, device: torch.device, folder: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    hooks = _marked(lm)
    try:
        if device.type == "cuda":
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            generate(steps + 2)  # the prompt's forward, then steps + 1 one-token forwards: steps spans between starts
            if device.type == "cuda":
                torch.cuda.synchronize()
    finally:
        for hook in hooks:
            hook.remove()
    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / f"{name}.trace.json"
    prof.export_chrome_trace(str(trace))
    summary = summarize(json.loads(trace.read_text()), steps)
    averages = prof.key_averages()
    summary["top_self_cpu"] = averages.table(sort_by="self_cpu_time_total", row_limit=25)
    if device.type == "cuda":
        summary["top_self_cuda"] = averages.table(sort_by="self_cuda_time_total", row_limit=25)
    summary["trace"] = str(trace)
    return summary


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarize(trace: dict, steps: int) -> dict:
    """Per-step figures from a chrome trace (times in microseconds there, milliseconds here)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    starts = sorted(e["ts"] for e in events if e.get("name") == MARK)[1:steps + 2]  # the prompt's forward left out
    if len(starts) < 2:
        return {"steps": 0}
    spans = list(zip(starts, starts[1:]))

    def step_of(ts: float) -> int | None:
        return next((i for i, (a, b) in enumerate(spans) if a <= ts < b), None)

    runtime = {}  # correlation id -> (step, host duration) of the runtime call that launched it
    names = [*SYNCS, "cudaMemcpyAsync DtoH", "aten::_local_scalar_dense"]  # the last: .item(), int(), .tolist()
    counts = [{k: [0, 0.0] for k in names} for _ in spans]  # per step: [calls, host ms]
    for e in events:
        step = step_of(e["ts"])
        if step is None:
            continue
        if e.get("cat") == "cuda_runtime":
            runtime[e.get("args", {}).get("correlation")] = (step, e.get("dur", 0))
        if e["name"] in counts[step]:
            counts[step][e["name"]][0] += 1
            counts[step][e["name"]][1] += e.get("dur", 0) / 1e3
    busy = [[] for _ in spans]
    for e in events:
        if e.get("cat") in DEVICE_CATS and e.get("args", {}).get("correlation") in runtime:
            step, host_dur = runtime[e["args"]["correlation"]]
            busy[step].append((e["ts"], e["ts"] + e.get("dur", 0)))
            if e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"]:
                counts[step]["cudaMemcpyAsync DtoH"][0] += 1
                counts[step]["cudaMemcpyAsync DtoH"][1] += host_dur / 1e3
    host = [(b - a) / 1e3 for a, b in spans]
    return {"steps": len(spans), "host_ms_per_step": statistics.mean(host),
            "gpu_busy_ms_per_step": statistics.mean(_union(b) / 1e3 for b in busy),
            "device_ops_per_step": statistics.mean(len(b) for b in busy),
            "per_step": {k: {"calls": statistics.mean(c[k][0] for c in counts),
                             "host_ms": statistics.mean(c[k][1] for c in counts)} for k in names}}


def report(name: str, summary: dict) -> str:
    if not summary.get("steps"):
        return f"{name}: no decode steps found in the profile"
    lines = [f"== {name}: {summary['steps']} decode steps profiled ({summary['trace']})",
             f"  host {summary['host_ms_per_step']:.2f} ms/step | GPU busy {summary['gpu_busy_ms_per_step']:.2f} "
             f"ms/step | {summary['device_ops_per_step']:.0f} kernels+copies/step",
             "  per step (calls, host ms): " + ", ".join(f"{k} {v['calls']:g} ({v['host_ms']:.2f} ms)"
                                                         for k, v in summary["per_step"].items()),
             f"-- top 25 by self CPU time\n{summary['top_self_cpu']}"]
    if "top_self_cuda" in summary:
        lines.append(f"-- top 25 by self CUDA time\n{summary['top_self_cuda']}")
    return "\n".join(lines)
