"""(h) Real-shaped data beside synthetic: the same model and options on one GPU, in one call, counting real tokens.

    python bench/real_shaped_data.py --out results/real --workers 8            # the dataset (docs/benchmarks.md)
    python bench/real_data.py --out results/real_data --data results/real/dataset --cases slice mid
    python bench/real_data.py --out /tmp/smoke --quick                         # the script itself, tiny, on a CPU

Each case is two `mimo run`s in bf16 with the same options: the provider's synthetic data (rows of seq_length
tokens, no padding) and `--data` of the real-shaped dataset (packed, the default); a case with --cuda-graphs
(`SYNTHETIC_ONLY`) runs the synthetic data alone. Every row has the first
iteration (its seconds, and from the process's start to its log line), and over the iterations after `--warmup`:
ms/iter, real tokens/s/GPU (tokens that are not padding; the synthetic data has none), TFLOP/s/GPU and MFU from
the FLOPs of the micro-batches run, samples/s, the packs' fill, the host's data wait (share of the iteration),
and the peak memory beside `mimo plan`'s estimate for the same options. A case's real/synthetic ratio of the
median real-token TFLOP/s is the figure issue 61 holds against 70% (slice) and 60% (mid).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import Results, device_description, mimo_run, plan_json, settings_args, spread

SLICE = dict(hybrid_pattern="MEMEM*EMEM", num_experts=16, backend="te")
# images up to 768 x 768 pixels (576 tokens: two fit the 1,200 image tokens a packed row gets on one H200): the
# processor's default (16.8 M pixels, 16,384 tokens) skipped a third of the real-shaped samples at sequence 4096
# (docs/benchmarks.md, Qwen3.5-VL on one GPU)
QWEN_SLICE = dict(layer_pattern="GGG*" * 4, num_experts=32, backend="te", max_pixels=768 * 768)
# name -> (provider, settings, micro-batch size, micro-batches, extra `mimo run` options)
CASES = {
    "slice": ("nemotron-moe-vlm-52l", SLICE, 1, 8, []),
    "mid": ("nemotron-moe-vlm-mid", {"backend": "te"}, 4, 2, []),
    # the whole released model (RADIO-H + 52 layers, 128 experts) with LoRA rank 16 on one GPU (issue 61)
    "lora52": ("nemotron-moe-vlm-52l", {"backend": "te", "seq_length": 4096}, 1, 8, ["--lora-rank", "16"]),
    # Qwen3.5-VL 35B-A3B at every released width, 16 of its 40 layers (the 3:1 delta-net/attention pattern), the
    # 32 experts one GPU holds under EP8 (issue 62); images up to 768 x 768 pixels (QWEN_SLICE)
    "qwen-slice": ("qwen3.5-vl-35b-a3b", QWEN_SLICE, 1, 8, []),
    # the same with its layers' mixers and MoE routers captured as CUDA graphs (the routed experts as grouped GEMMs:
    # expert_gemm auto); synthetic data only: packed --data refuses --cuda-graphs
    "qwen-slice-graphs": ("qwen3.5-vl-35b-a3b", QWEN_SLICE, 1, 8, ["--cuda-graphs"]),
    # the whole 35B-A3B (every layer and expert) with LoRA rank 16 on one GPU (issue 62), on the provider's default
    # targets: routed experts included (held by the grouped experts, fc1's B in gate and up parts: docs/lora.md)
    "qwen-lora": ("qwen3.5-vl-35b-a3b", {"backend": "te", "seq_length": 4096, "max_pixels": 768 * 768}, 1, 8,
                  ["--lora-rank", "16"]),
}
QUICK_CASES = {"tiny": ("nemotron-moe-vlm-tiny", {"backend": "local"}, 2, 2, [])}
SYNTHETIC_ONLY = {"qwen-slice-graphs"}  # captured graphs replay fixed shapes: packed real-shaped rows have none
# metrics-file keys: the real-token figures, with --data; the synthetic run's tokens are all real
FIGURES = {  # row key -> metrics key (with --data, tokens and FLOPs are the samples' own, padding left out)
    "ms_per_iter": "elapsed_ms",
    "real_tokens_per_s_per_gpu": "tokens_per_sec_per_gpu",
    "tflops": "tflops_per_gpu",
    "samples_per_s": "samples_per_sec",
    "data_wait_share": "data_wait_share",
    "padding_share": "padding_share",
    "samples_per_row": "samples_per_row",
}
COLUMNS = [
    ("case", "case", ""), ("status", "status", ""), ("first_iteration_s", "iteration 1 s", ".1f"),
    ("ms_per_iter", "ms/iter min-median-max", ""), ("real_tokens_per_s_per_gpu", "real tokens/s/GPU", ""),
    ("tflops", "TFLOP/s/GPU min-median-max", ""), ("mfu", "MFU", ".1%"), ("samples_per_s", "samples/s", ""),
    ("samples_per_row", "samples/row", ""), ("padding_share", "padding", ""), ("data_wait_share", "data wait", ""), ("peak_memory_gib", "peak GiB", ".1f"),
    ("plan_allocated_gib", "plan GiB", ".1f"),
]


def case_args(case, device: str, iterations: int, data: Path | None) -> list[str]:
    provider, settings, mbs, microbatches, options = case
    return ["--provider", provider, *settings_args(settings), "--precision", "bf16", "--device", device,
            "--micro-batch-size", str(mbs), "--num-microbatches", str(microbatches), "--train-iters",
            str(iterations), "--log-interval", "1", *options, *(["--data", str(data)] if data else [])]


def plan_args(args: list[str]) -> list[str]:
    """The run's options that `mimo plan` takes (the loop's own left out)."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in ("--train-iters", "--log-interval"):
            skip = True
            continue
        kept.append(arg)
    return kept


def plan_estimate(args: list[str]) -> dict:
    """`mimo plan`'s largest rank (GiB) for the run's options: its total (allowance included) and what it expects
    allocated (the total less the allowance; a measured peak compares with this), and the packs it counted."""
    plan, _ = plan_json(plan_args(args))
    if plan is None:
        return {"plan_gib": None, "plan_allocated_gib": None, "plan_packs": None}
    return {"plan_gib": plan["largest"]["total"], "plan_allocated_gib": plan["largest"]["allocated"],
            "plan_packs": plan.get("packs")}


def run_one(name: str, case, out: Path, device: str, iterations: int, warmup: int, data: Path | None,
            timeout: float, snapshot: bool = False) -> dict:
    args = case_args(case, device, iterations, data)
    snapshots = out / f"{name}-snapshot"
    extra = ["--memory-snapshot-dir", str(snapshots), "--memory-snapshot-iteration", str(iterations)] if snapshot else []
    run = mimo_run(args + extra, out, name, timeout=timeout)
    if snapshot and snapshots.is_dir():  # what was live at the peak, by allocation site, beside the plan's terms
        report = subprocess.run([sys.executable, "scripts/memory_at_peak.py", str(snapshots), "--top", "60"],
                                capture_output=True, text=True)
        (out / f"{name}-peak.txt").write_text(report.stdout + report.stderr)
        plan = subprocess.run([sys.executable, "-m", "mimo.cli", "plan", *plan_args(args)], capture_output=True,
                              text=True)
        (out / f"{name}-plan.txt").write_text(plan.stdout + plan.stderr)
        for pickle_file in snapshots.glob("*.pickle"):
            pickle_file.unlink()  # large; the report keeps what was live at the peak
    row = {"case": name, "provider": case[0], "data": "real-shaped" if data else "synthetic", "status": run.status,
           "command": run.printed(), "to_first_iteration_end_s": run.to_first_iteration_s, "wall_s": run.seconds,
           **plan_estimate(args),
           "compile_report": next((line.strip() for line in run.output.splitlines()
                                   if line.startswith("first iteration ")), None)}
    if run.records and run.records[0]["iteration"] == 1:
        row["first_iteration_s"] = run.records[0]["elapsed_ms"] / 1000
    kept = [r for r in run.records if r["iteration"] > warmup]
    for key, metric in FIGURES.items():
        if figures := spread(kept, metric):
            row[f"{key}_spread"] = figures
            digits = ".0%" if "share" in key else ".1f" if key == "samples_per_row" else ".0f"
            row[key] = "-".join(format(figures[k], digits) for k in ("min", "median", "max"))
    if (mfu := spread(kept, "mfu")) is not None:
        row["mfu"] = mfu["median"]
    peaks = [r["peak_memory_gib"] for r in run.records if r.get("peak_memory_gib") is not None]
    row["peak_memory_gib"] = max(peaks) if peaks else None
    if peaks and row["plan_allocated_gib"]:  # issue 61: the peak within 5% of the plan, never above it
        row["peak_of_plan"] = round(row["peak_memory_gib"] / row["plan_allocated_gib"], 4)
    row["steady_iterations"] = len(kept)
    row["last_record"] = run.records[-1] if run.records else None
    return row


def ratios(rows: list[dict]) -> list[str]:
    """real / synthetic of each case's median real-token TFLOP/s and tokens/s."""
    notes = []
    by = {(r["provider"], r["data"]): r for r in rows}
    for (provider, kind), real in by.items():
        synthetic = by.get((provider, "synthetic"))
        if kind != "real-shaped" or not synthetic:
            continue
        parts = []
        for key, what in (("tflops_spread", "TFLOP/s/GPU"), ("real_tokens_per_s_per_gpu_spread", "real tokens/s/GPU")):
            if real.get(key) and synthetic.get(key):
                parts.append(f"{what} {real[key]['median'] / synthetic[key]['median']:.0%}")
        if parts:
            notes.append(f"{provider}: real-shaped / synthetic, medians: {', '.join(parts)}")
    return notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/real_data"))
    parser.add_argument("--data", type=Path, default=None, help="the real-shaped dataset (bench/real_shaped_data.py)")
    parser.add_argument("--cases", nargs="*", default=None, help="default: all")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="iterations left out of the figures")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a run may take before it is killed")
    parser.add_argument("--only", choices=("synthetic", "real"), default=None, help="one of each case's two runs")
    parser.add_argument("--quick", action="store_true", help="tiny settings on the CPU: checks the script only")
    parser.add_argument("--snapshot", action="store_true", help="record the allocator's memory over every iteration "
                        "and write what was live at the peak (NAME-peak.txt) beside mimo plan's terms (NAME-plan.txt)")
    args = parser.parse_args()
    cases, device = (QUICK_CASES, "cpu") if args.quick else (CASES, "cuda")
    names = args.cases or list(cases)
    if unknown := sorted(set(names) - set(cases)):
        parser.error(f"unknown case {unknown[0]}: choose among {', '.join(cases)}")
    if args.data is None:
        parser.error("--data DIR: a real-shaped dataset (python bench/real_shaped_data.py --out DIR makes DIR/dataset)")
    results = Results("real_data", COLUMNS)
    for name in names:
        for kind, data in (("synthetic", None), ("real", args.data)):
            if (args.only and args.only != kind) or (kind == "real" and name in SYNTHETIC_ONLY):
                continue
            results.rows.append(run_one(f"{name}-{kind}", cases[name], args.out, device, args.iterations,
                                        args.warmup, data, args.timeout, args.snapshot))
            results.notes = ratios(results.rows) + [f"{r['case']}: {r['compile_report']}" for r in results.rows
                                                    if r.get("compile_report")]
            results.write(args.out, extra={"device_info": device_description()}, show=False)
    results.write(args.out)


if __name__ == "__main__":
    main()
