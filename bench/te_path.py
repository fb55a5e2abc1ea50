"""(f) The transformer-engine path on one GPU: backend te against local, and the loop's performance options.

    python bench/te_path.py --out results/te_path                      # on a GPU machine with transformer-engine
    python bench/te_path.py --out results/te_path --cases slice-te mid-te --profile slice-te
    python bench/te_path.py --out results/base --cases slice-te --baseline-src bench_baseline   # main, same call
    python bench/te_path.py --summarize results                        # one table of every te_path.json below
    python bench/te_path.py --out /tmp/smoke --quick                   # the script itself, tiny, on a CPU

Each case is one `mimo run` in bf16 (the models of bench/throughput.py: `dense` is mock-vlm with a 303M ViT and a
1.34B GPT at sequence 4096; `mid` is nemotron-moe-vlm-mid; `slice` is the released Nemotron 3 Nano's width,
hidden 2688, Mamba-2 64x64, MoE FFN 1856 top 6 with a 3712 shared expert, in 10 layers `MEMEM*EMEM` with 16
experts, sequence 8192: top-6 of 16 experts on one GPU gives each expert the tokens of 128 experts under EP8).
Every row has the first iteration's seconds (its interval, and from the start of the process to its log line:
start-up, model build, compilation) and the steady figures as min/median/max over the iterations after
`--warmup` (a profiled iteration is left out). Besides the summary (te_path.json) every run writes a record
`records/<case>.json` with the fields docs/benchmarks/ keeps: device, provider, backend, precision, layout,
ms_per_iter, tokens_per_s_per_gpu, tflops_per_gpu, mfu, peak_mem_gib (and the command).

`--baseline-src DIR` runs the cases with DIR (a folder holding another checkout's `mimo` package, e.g. from
`git archive COMMIT --prefix=mimo/`) first on PYTHONPATH, named `CASE@base`, with the case's options only (not
`--extra`, which an older mimo may not know): compare figures only with a baseline of the same machine and call.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
from pathlib import Path

from common import Results, device_description, mimo_run, profile_notes, settings_args, spread, steady
from throughput import DENSE, QUICK

SLICE = dict(hybrid_pattern="MEMEM*EMEM", num_experts=16, backend="te")

# name -> (provider, settings, micro-batch size, micro-batches, extra `mimo run` options)
CASES = {
    "slice-te": ("nemotron-moe-vlm-52l", SLICE, 1, 8, []),
    "slice-te-graphs": ("nemotron-moe-vlm-52l", SLICE, 1, 8, ["--cuda-graphs"]),
    "slice-te-fp8": ("nemotron-moe-vlm-52l", SLICE, 1, 8, ["--cuda-graphs", "--fp8", "tensorwise"]),
    "dense-local": ("mock-vlm", {**DENSE, "backend": "local"}, 2, 4, []),
    "dense-te": ("mock-vlm", {**DENSE, "backend": "te"}, 2, 4, []),
    "dense-te-mbs4": ("mock-vlm", {**DENSE, "backend": "te"}, 4, 2, []),
    "dense-te-graphs": ("mock-vlm", {**DENSE, "backend": "te"}, 2, 4, ["--cuda-graphs"]),
    "dense-te-graphs-mbs4": ("mock-vlm", {**DENSE, "backend": "te"}, 4, 2, ["--cuda-graphs"]),
    "dense-te-graphs-fp8-mbs4": ("mock-vlm", {**DENSE, "backend": "te"}, 4, 2, ["--cuda-graphs", "--fp8", "tensorwise"]),
    "dense-te-mbs8-selective": ("mock-vlm", {**DENSE, "backend": "te"}, 8, 1, ["--recompute", "selective"]),
    "dense-te-fp8": ("mock-vlm", {**DENSE, "backend": "te"}, 2, 4, ["--fp8", "tensorwise"]),
    "dense-te-fp8-mbs4": ("mock-vlm", {**DENSE, "backend": "te"}, 4, 2, ["--fp8", "tensorwise"]),
    "mid-local": ("nemotron-moe-vlm-mid", {"backend": "local"}, 4, 2, []),
    "mid-te": ("nemotron-moe-vlm-mid", {"backend": "te"}, 4, 2, []),
    "mid-te-mbs8-selective": ("nemotron-moe-vlm-mid", {"backend": "te"}, 8, 1, ["--recompute", "selective"]),
    "mid-te-graphs": ("nemotron-moe-vlm-mid", {"backend": "te"}, 4, 2, ["--cuda-graphs"]),
    "mid-te-mbs8-selective-graphs": ("nemotron-moe-vlm-mid", {"backend": "te"}, 8, 1,
                                     ["--recompute", "selective", "--cuda-graphs"]),
    "mid-te-mbs16-full": ("nemotron-moe-vlm-mid", {"backend": "te"}, 16, 1, ["--recompute", "language=full"]),
    "mid-te-fp8": ("nemotron-moe-vlm-mid", {"backend": "te"}, 4, 2, ["--fp8", "tensorwise"]),
}
QUICK_CASES = {
    "dense-local": ("mock-vlm", {**QUICK, "backend": "local"}, 2, 2, []),
    "dense-local-selective": ("mock-vlm", {**QUICK, "backend": "local"}, 2, 2, ["--recompute", "selective"]),
    "mid-local": ("nemotron-moe-vlm-tiny", {"backend": "local"}, 2, 2, ["--recompute", "language=full"]),
    "slice-local": ("nemotron-moe-vlm-tiny", {"backend": "local"}, 1, 4, []),  # the slice's shape of run
}
BASE = "@base"
COLUMNS = [
    ("case", "case", ""), ("status", "status", ""), ("global_batch", "global batch", "d"),
    ("first_iteration_s", "iteration 1 s", ".1f"), ("to_first_iteration_end_s", "to its end s", ".1f"),
    ("ms_per_iter", "ms/iter min-median-max", ""), ("tflops", "TFLOP/s/GPU min-median-max", ""),
    ("mfu", "MFU", ".1%"), ("peak_memory_gib", "peak GiB", ".1f"), ("alloc_retries", "alloc retries", "d"),
]


def run_case(name: str, case, out: Path, device: str, iterations: int, warmup: int, profile: bool,
             extra: list[str], timeout: float, baseline: Path | None = None) -> dict:
    provider, settings, mbs, microbatches, options = case
    args = ["--provider", provider, *settings_args(settings), "--precision", "bf16", "--device", device,
            "--micro-batch-size", str(mbs), "--num-microbatches", str(microbatches),
            "--train-iters", str(iterations), "--log-interval", "1", *options]
    profiled = (warmup + 1, warmup + 1) if profile else None
    label = name + (BASE if baseline else "")
    if profiled:
        args += ["--profile-dir", str(out / f"profile_{label}"), "--profile-step-start", str(profiled[0]),
                 "--profile-step-end", str(profiled[1])]
    env = None
    if baseline:  # another checkout's mimo first on the path; options it may not know stay out
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(baseline.resolve()),
                                                           os.environ.get("PYTHONPATH")]))}
    else:
        args += extra
    run = mimo_run(args, out, label, timeout=timeout, env=env)
    row = {"case": label, "provider": provider, "backend": settings.get("backend", "auto"), "precision": "bf16",
           "options": " ".join(options + ([] if baseline else extra)), "micro_batch": mbs,
           "global_batch": mbs * microbatches, "status": run.status, "command": run.printed(),
           "source": str(baseline) if baseline else "this checkout",
           "to_first_iteration_end_s": run.to_first_iteration_s, "wall_s": run.seconds,
           "compile_report": next((line.strip() for line in run.output.splitlines()
                                   if line.startswith("first iteration ")), None),
           "lm_losses": [r["lm_loss"] for r in run.records]}
    if run.records and run.records[0]["iteration"] == 1:
        row["first_iteration_s"] = run.records[0]["elapsed_ms"] / 1000
    kept = [r for r in run.records if r["iteration"] > warmup and not (profiled and r["iteration"] == profiled[0])]
    if kept:
        row.update(steady(kept, warmup_records=0))
        row["steady_iterations"] = len(kept)
        for key, short in (("elapsed_ms", "ms_per_iter"), ("tflops_per_gpu", "tflops"),
                           ("tokens_per_sec_per_gpu", "tokens_per_s")):
            figures = spread(kept, key)
            if figures:
                row[f"{short}_spread"] = figures
                row[short] = "-".join(f"{figures[k]:.0f}" for k in ("min", "median", "max"))
        if (mfu := spread(kept, "mfu")) is not None:
            row["mfu"] = mfu["median"]
        row["lm_loss_last"] = run.records[-1]["lm_loss"]
        without_captures(row, kept, capture_iterations(run.output))
    if run.records:
        row["alloc_retries"] = run.records[-1].get("alloc_retries")
    summary = out / f"profile_{label}" / "summary_rank0.json"
    if summary.exists():
        row["profile"] = json.loads(summary.read_text())
    return row


ITERATION_LINE = re.compile(r"^\s*iteration\s+(\d+)/")


def capture_iterations(output: str) -> list[int]:
    """The iterations during which a CUDA graph of a new shape was captured (the recomputed encoder's bucket of
    packed patches, plugins/kit/recompute_graphs.py): its line comes before the iteration's log line."""
    pending, found = 0, []
    for line in output.splitlines():
        if "CUDA graph for" in line and " captured in " in line:
            pending += 1
        elif (m := ITERATION_LINE.match(line)) and pending:
            found.append(int(m.group(1)))
            pending = 0
    return found


def without_captures(row: dict, kept: list[dict], captured: list[int]) -> None:
    """The steady figures again over the iterations that captured nothing: what a long run, whose buckets have
    all been captured, settles to (each capture is a one-time cost of 0.1-0.3 s)."""
    row["capture_iterations"] = captured
    clean = [r for r in kept if r["iteration"] not in captured]
    if clean and len(clean) < len(kept):
        for key, short in (("elapsed_ms", "ms_per_iter"), ("tflops_per_gpu", "tflops")):
            if (figures := spread(clean, key)) is not None:
                row[f"{short}_without_captures_spread"] = figures


def record(row: dict, device: dict) -> dict:
    """The per-run record docs/benchmarks/ keeps."""
    return {
        "device": device.get("gpu") or "cpu", "provider": row["provider"], "backend": row["backend"],
        "precision": row["precision"] + (" + fp8 " + row["options"].split("--fp8 ")[1].split()[0]
                                         if "--fp8" in row["options"] else ""),
        "layout": "colocated, 1 rank", "options": row["options"], "micro_batch": row["micro_batch"],
        "global_batch": row["global_batch"], "status": row["status"], "source": row["source"],
        "first_iteration_s": row.get("first_iteration_s"),
        "to_first_iteration_end_s": row.get("to_first_iteration_end_s"),
        "ms_per_iter": row.get("elapsed_ms"), "ms_per_iter_spread": row.get("ms_per_iter_spread"),
        "tokens_per_s_per_gpu": row.get("tokens_per_sec_per_gpu"),
        "tflops_per_gpu": row.get("tflops_per_gpu"), "tflops_spread": row.get("tflops_spread"),
        "mfu": row.get("mfu"), "tokens_counted": row.get("tokens_counted"), "flops_counted": row.get("flops_counted"),
        "peak_mem_gib": row.get("peak_memory_gib"),
        "alloc_retries": row.get("alloc_retries"), "compile_report": row.get("compile_report"),
        "capture_iterations": row.get("capture_iterations"),
        "ms_per_iter_without_captures": row.get("ms_per_iter_without_captures_spread"),
        "tflops_without_captures": row.get("tflops_without_captures_spread"),
        "command": row["command"],
    }


def capture_notes(rows: list[dict]) -> list[str]:
    notes = []
    for r in rows:
        ms, tf = r.get("ms_per_iter_without_captures_spread"), r.get("tflops_without_captures_spread")
        if ms and tf:
            notes.append(f"{r['case']}: {ms['n']} steady iterations captured no graph: ms/iter "
                         f"{ms['min']:.0f}-{ms['median']:.0f}-{ms['max']:.0f}, TFLOP/s/GPU "
                         f"{tf['min']:.0f}-{tf['median']:.0f}-{tf['max']:.0f} (captures at iterations "
                         f"{', '.join(map(str, r['capture_iterations']))})")
    return notes


def summarize(folder: Path) -> None:
    """One table of the rows of every te_path.json under `folder`, each case named by its subfolder."""
    results = Results("te_path summary", COLUMNS)
    for path in sorted(folder.rglob("te_path.json")):
        for row in json.loads(path.read_text())["rows"]:
            results.rows.append({**row, "case": f"{path.parent.relative_to(folder)}/{row['case']}"})
            if row.get("compile_report"):
                results.notes.append(f"{path.parent.relative_to(folder)}/{row['case']}: {row['compile_report']}")
            results.notes += [f"{path.parent.relative_to(folder)}/{note}" for note in capture_notes([row])]
    results.print_table()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/te_path"))
    parser.add_argument("--cases", nargs="*", default=None, help="default: all")
    parser.add_argument("--profile", nargs="*", default=[], help="cases to profile (one iteration after warm-up)")
    parser.add_argument("--iterations", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=3, help="iterations left out of the figures")
    parser.add_argument("--extra", default="", help="`mimo run` options added to every case (not to a baseline)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a case may run before it is killed")
    parser.add_argument("--baseline-src", type=Path, default=None,
                        help="run the cases with this folder's `mimo` package instead (named CASE@base)")
    parser.add_argument("--summarize", type=Path, default=None, help="print one table of every te_path.json here")
    parser.add_argument("--quick", action="store_true", help="tiny settings on the CPU: checks the script only")
    args = parser.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    cases, device = (QUICK_CASES, "cpu") if args.quick else (CASES, "cuda")
    names = args.cases or list(cases)
    unknown = sorted(set(names + args.profile) - set(cases))
    if unknown:
        parser.error(f"unknown case {unknown[0]}: choose among {', '.join(cases)}")
    if args.baseline_src and not (args.baseline_src / "mimo" / "__init__.py").is_file():
        parser.error(f"--baseline-src {args.baseline_src}: no mimo package there (git archive COMMIT --prefix=mimo/)")

    results = Results("te_path", COLUMNS)
    info = device_description()
    (args.out / "records").mkdir(parents=True, exist_ok=True)
    for name in names:
        row = run_case(name, cases[name], args.out, device, args.iterations, args.warmup, name in args.profile,
                       shlex.split(args.extra), args.timeout, args.baseline_src)
        results.rows.append(row)
        (args.out / "records" / f"{row['case']}.json").write_text(json.dumps(record(row, info), indent=1))
        results.notes = profile_notes(results.rows) + [f"{r['case']}: {r['compile_report']}" for r in results.rows
                                                      if r.get("compile_report")] + capture_notes(results.rows)
        results.write(args.out, show=False)  # after every case: a killed call keeps what finished
    results.write(args.out)


if __name__ == "__main__":
    main()
