"""`--memory-snapshot-dir`: the GPU allocator's history from start-up to the end of one iteration, per rank.

torch records every allocation and free with the Python stack that made it (`torch.cuda.memory`); the pickle it
writes opens in https://pytorch.org/memory_viz, and `python scripts/memory_at_peak.py DIR` lists what was live at
the rank's peak, by the code that allocated it: what to set against `mimo plan`'s terms (weights, gradients,
optimizer state, activations) where the plan and a measured peak differ. Recording starts before the model is
built, so the weights, gradient buffers and optimizer state are in it; it slows the host a little while it runs.
"""

from __future__ import annotations

from pathlib import Path

import torch

MAX_ENTRIES = 2_000_000  # allocator events kept: start-up and a few iterations of a large model


class MemorySnapshot:
    """Records from construction to the end of `iteration`, then writes memory_rank{rank}.pickle; a no-op
    without a directory."""

    def __init__(self, directory: Path | None, iteration: int, *, rank: int):
        self.directory, self.iteration, self.rank = directory, iteration, rank
        self.recording = directory is not None  # on GPU runs only: joining the world refuses it on the CPU
        if self.recording:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")

    def after(self, iteration: int) -> None:
        if not self.recording or iteration != self.iteration:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"memory_rank{self.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False
        if self.rank == 0:
            print(f"memory snapshot of iterations 1-{iteration}: {path} (python scripts/memory_at_peak.py "
                  f"{self.directory})", flush=True)


_SKIPPED = ("/torch/", "<frozen", "/contextlib.py", "/functools.py")  # frames that say nothing of who allocated


def allocation_site(frames: list[dict]) -> str:
    """The innermost frame of the code that asked for the memory (not torch's own), as file:line function."""
    for frame in frames:
        name = frame.get("filename", "")
        if not any(part in name for part in _SKIPPED):
            short = name.split("site-packages/")[-1]
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    return "(torch internals or no stack)"


def peak_report(snapshot: dict, device: int = 0, top: int = 40) -> dict:
    """What was live at the peak of the recorded window on `device`: bytes by allocation site. The blocks live at
    the dump but allocated before recording began count as `before_recording` (constant over the window)."""
    trace = snapshot["device_traces"][device]
    frees = {"free_requested"} if any(e["action"] == "free_requested" for e in trace) else {"free_completed"}

    def replay(stop: int | None = None):
        live, total, peak, at = {}, 0, 0, -1
        for i, event in enumerate(trace if stop is None else trace[:stop + 1]):
            if event["action"] == "alloc":
                live[event["addr"]] = (event["size"], event.get("frames", []))
                total += event["size"]
                if total > peak:
                    peak, at = total, i
            elif event["action"] in frees and event["addr"] in live:
                total -= live.pop(event["addr"])[0]
        return live, total, peak, at

    live_at_end, total_at_end, peak, at = replay()
    allocated_at_end = sum(b["size"] for s in snapshot["segments"] if s.get("device", device) == device
                           for b in s["blocks"] if b["state"] == "active_allocated")
    before = max(0, allocated_at_end - total_at_end)
    live, _, _, _ = replay(at)
    sites: dict[str, list] = {}
    for size, frames in live.values():
        entry = sites.setdefault(allocation_site(frames), [0, 0])
        entry[0] += size
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])
    return {"peak_bytes": peak + before, "before_recording_bytes": before, "events": len(trace),
            "peak_event": at, "sites": [{"site": site, "bytes": b, "blocks": n} for site, (b, n) in ranked[:top]],
            "other_bytes": sum(b for _, (b, _) in ranked[top:])}
