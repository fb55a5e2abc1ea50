"""(f) The transformer-engine path on one GPU: backend te against local, and the loop's performance options.

    python bench/te_path.py --out results/te_path                      # on a GPU machine with transformer-engine
    python bench/te_path.py --out results/te_path --cases dense-te mid-te --profile dense-te
    python bench/te_path.py --out /tmp/smoke --quick                   # the script itself, tiny, on a CPU

Each case is one `mimo run` in bf16 (the models of bench/throughput.py: `dense` is mock-vlm with a 303M ViT and a
1.34B GPT at sequence 4096; `mid` is nemotron-moe-vlm-mid). Figures average the logged intervals after
`--warmup` iterations; a profiled interval is left out. Besides the summary (te_path.json) every run writes a
record `records/<case>.json` with the fields docs/benchmarks/ keeps: device, provider, backend, precision, layout,
ms_per_iter, tokens_per_s_per_gpu, tflops_per_gpu, mfu, peak_mem_gib (and the command).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import Results, device_description, mimo_run, profile_notes, settings_args, steady
from throughput import DENSE, QUICK

# name -> (provider, settings, micro-batch size, micro-batches, extra `mimo run` options)
CASES = {
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
    "mid-te-mbs16-full": ("nemotron-moe-vlm-mid", {"backend": "te"}, 16, 1, ["--recompute", "language=full"]),
    "mid-te-fp8": ("nemotron-moe-vlm-mid", {"backend": "te"}, 4, 2, ["--fp8", "tensorwise"]),
}
QUICK_CASES = {
    "dense-local": ("mock-vlm", {**QUICK, "backend": "local"}, 2, 2, []),
    "dense-local-selective": ("mock-vlm", {**QUICK, "backend": "local"}, 2, 2, ["--recompute", "selective"]),
    "mid-local": ("nemotron-moe-vlm-tiny", {"backend": "local"}, 2, 2, ["--recompute", "language=full"]),
}


def run_case(name: str, case, out: Path, device: str, iterations: int, warmup: int, profile: bool) -> dict:
    provider, settings, mbs, microbatches, extra = case
    args = ["--provider", provider, *settings_args(settings), "--precision", "bf16", "--device", device,
            "--micro-batch-size", str(mbs), "--num-microbatches", str(microbatches),
            "--train-iters", str(iterations), "--log-interval", "1", *extra]
    profiled = (warmup + 1, warmup + 1) if profile else None
    if profiled:
        args += ["--profile-dir", str(out / f"profile_{name}"), "--profile-step-start", str(profiled[0]),
                 "--profile-step-end", str(profiled[1])]
    run = mimo_run(args, out, name)
    row = {"case": name, "provider": provider, "backend": settings.get("backend", "auto"), "precision": "bf16",
           "options": " ".join(extra), "micro_batch": mbs, "global_batch": mbs * microbatches,
           "status": run.status, "command": run.printed()}
    kept = [r for r in run.records if r["iteration"] > warmup and not (profiled and r["iteration"] == profiled[0])]
    if kept:
        row.update(steady(kept, warmup_records=0))
        row["lm_loss_last"] = run.records[-1]["lm_loss"]
    summary = out / f"profile_{name}" / "summary_rank0.json"
    if summary.exists():
        row["profile"] = json.loads(summary.read_text())
    return row


def record(row: dict, device: dict) -> dict:
    """The per-run record docs/benchmarks/ keeps."""
    return {
        "device": device.get("gpu") or "cpu", "provider": row["provider"], "backend": row["backend"],
        "precision": row["precision"] + (" + fp8 " + row["options"].split("--fp8 ")[1].split()[0]
                                         if "--fp8" in row["options"] else ""),
        "layout": "colocated, 1 rank", "options": row["options"], "micro_batch": row["micro_batch"],
        "global_batch": row["global_batch"], "status": row["status"],
        "ms_per_iter": row.get("elapsed_ms"), "tokens_per_s_per_gpu": row.get("tokens_per_sec_per_gpu"),
        "tflops_per_gpu": row.get("tflops_per_gpu"), "mfu": row.get("mfu"), "peak_mem_gib": row.get("peak_memory_gib"),
        "command": row["command"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/te_path"))
    parser.add_argument("--cases", nargs="*", default=None, help="default: all")
    parser.add_argument("--profile", nargs="*", default=[], help="cases to profile (one iteration after warm-up)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="iterations left out of the figures")
    parser.add_argument("--quick", action="store_true", help="tiny settings on the CPU: checks the script only")
    args = parser.parse_args()
    cases, device = (QUICK_CASES, "cpu") if args.quick else (CASES, "cuda")
    names = args.cases or list(cases)
    unknown = sorted(set(names + args.profile) - set(cases))
    if unknown:
        parser.error(f"unknown case {unknown[0]}: choose among {', '.join(cases)}")

    results = Results("te_path", [
        ("case", "case", ""), ("status", "status", ""), ("global_batch", "global batch", "d"),
        ("elapsed_ms", "ms/iter", ".0f"), ("tokens_per_sec_per_gpu", "tokens/s/GPU", ".0f"),
        ("tflops_per_gpu", "TFLOP/s/GPU", ".1f"), ("mfu", "MFU", ".1%"), ("peak_memory_gib", "peak GiB", ".1f"),
    ])
    info = device_description()
    (args.out / "records").mkdir(parents=True, exist_ok=True)
    for name in names:
        row = run_case(name, cases[name], args.out, device, args.iterations, args.warmup, name in args.profile)
        results.rows.append(row)
        (args.out / "records" / f"{name}.json").write_text(json.dumps(record(row, info), indent=1))
    results.notes += profile_notes(results.rows)
    results.write(args.out)


if __name__ == "__main__":
    main()
