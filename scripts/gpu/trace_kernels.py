"""The GPU kernels of a profiled iteration with their whole names and the host operations that launched them, from
a `--profile-dir` Chrome trace: what the run's summary (names cut at 160 characters, sites for the 15 busiest
kernels only) leaves out, for finding which operation an element-wise or copy kernel belongs to.

    python3 scripts/gpu/trace_kernels.py RUN/profile_slice-te-graphs/trace_rank0.json --iterations 1 --top 60

Prints, for the `--top` kernels by total time, milliseconds per iteration, launches, the kernel's name and its
three busiest launch sites (the innermost host operation around each launch, with its input shapes when the trace
has them; a CUDA graph's kernels name the graph's replay)."""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict


def _innermost(ops: list[dict], starts: list[float], moment: float) -> str:
    """The shortest host operation of the launching thread that spans `moment`."""
    best = None
    for op in reversed(ops[max(0, bisect.bisect_right(starts, moment) - 4000):bisect.bisect_right(starts, moment)]):
        if op["ts"] <= moment <= op["ts"] + op.get("dur", 0) and (best is None or op["dur"] < best["dur"]):
            best = op
    if best is None:
        return "(no host operation)"
    shapes = best.get("args", {}).get("Input Dims")
    return best["name"] + (f" {shapes}" if shapes else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--iterations", type=int, default=1, help="iterations the trace covers")
    parser.add_argument("--top", type=int, default=60)
    args = parser.parse_args()
    events = json.load(open(args.trace))["traceEvents"]
    # runtime and driver API calls both launch kernels (cuBLAS's and transformer-engine's through the driver)
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops_by_thread = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e and not e["name"].startswith("mimo/"):
            ops_by_thread[(e["pid"], e["tid"])].append(e)
    starts = {}
    for key, ops in ops_by_thread.items():
        ops.sort(key=lambda op: op["ts"])
        starts[key] = [op["ts"] for op in ops]
    totals, counts = defaultdict(float), defaultdict(int)
    sites = defaultdict(lambda: defaultdict(float))
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        name, ms = e["name"], e.get("dur", 0) / 1000 / args.iterations
        totals[name] += ms
        counts[name] += 1
        launch = launches.get(e.get("args", {}).get("correlation"))
        key = (launch["pid"], launch["tid"]) if launch else None
        site = _innermost(ops_by_thread[key], starts[key], launch["ts"]) if key in starts else "(unknown)"
        sites[name][site] += ms
    busy = sum(totals.values())
    print(f"{busy:.1f} ms of GPU work per iteration in {sum(counts.values()) // args.iterations} kernels")
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"\n{ms:8.2f} ms  {counts[name] // args.iterations:5d}x  {name[:400]}")
        for site, site_ms in sorted(sites[name].items(), key=lambda kv: -kv[1])[:3]:
            print(f"{'':10}{site_ms:8.2f} ms  {site[:300]}")


if __name__ == "__main__":
    main()
