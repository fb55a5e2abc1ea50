"""`mimo plan`'s memory estimate against the measured peak, per rank: a short `mimo run` per case, then the
estimate (the same code `mimo plan --json` runs) next to torch's `max_memory_allocated` of every rank.

    python scripts/gpu/measure_memory.py --out results/memory                      # one GPU (H100 80 GB), ~6 min
    python scripts/gpu/measure_memory.py --out results/memory --cases heterogeneous  # two GPUs
    python scripts/gpu/measure_memory.py --out results/memory --cases several        # four H200s, ~15 min
    python scripts/gpu/measure_memory.py --out /tmp/memory --quick                 # the script itself, on a CPU

The estimate compared is the sum of the named terms (parameters, gradients, optimizer state, activations), what
the allocator is asked for; the allowance (CUDA context and allocator) is left out of the ratio and covers the
reserved memory. Target: each ratio estimate / measured within 0.85-1.15. The vision encoder is estimated at its
largest images (max_patches, what a plan must allow for); the Nemotron cases draw every image at that size
(min_patches = max_patches) so the measured peak is of the batch the estimate describes. Writes memory_check.json
(every record) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

# bench/throughput.py's dense model: a 310M ViT and a 1.34B GPT, sequence 4096
DENSE = dict(image_size=448, patch_size=14, vision_hidden_size=1024, vision_layers=24, vision_heads=16,
             hidden_size=2048, num_layers=24, num_attention_heads=16, seq_length=4096, vocab_size=32000)
# bench/layouts.py's encoder-heavy model, for the two-GPU heterogeneous case
HEAVY = dict(image_size=448, patch_size=14, vision_hidden_size=1280, vision_layers=32, vision_heads=16,
             hidden_size=2048, num_layers=8, num_attention_heads=16, seq_length=2048, vocab_size=32000)
QUICK = dict(image_size=32, patch_size=8, vision_hidden_size=64, vision_layers=2, vision_heads=4, hidden_size=64,
             num_layers=2, num_attention_heads=4, seq_length=128, vocab_size=512)

MID = "nemotron-moe-vlm-mid"
LARGEST_IMAGES = {"min_patches": 2048}  # the mid model's max_patches: every synthetic image at the largest size
# name -> (provider, settings, micro-batch size, micro-batches, extra options, processes)
CASES = {
    "dense-local": ("mock-vlm", {**DENSE, "backend": "local"}, 2, 4, [], 1),
    "dense-te": ("mock-vlm", {**DENSE, "backend": "te"}, 2, 4, [], 1),
    "dense-te-mbs4-full": ("mock-vlm", {**DENSE, "backend": "te"}, 4, 2, ["--recompute", "full"], 1),
    "dense-te-distopt": ("mock-vlm", {**DENSE, "backend": "te"}, 2, 4, ["--use-distributed-optimizer"], 1),
    "mid-local": (MID, {**LARGEST_IMAGES, "backend": "local"}, 4, 2, [], 1),
    "mid-te": (MID, {**LARGEST_IMAGES, "backend": "te"}, 4, 2, [], 1),
    "mid-te-mbs8-full": (MID, {**LARGEST_IMAGES, "backend": "te"}, 8, 1, ["--recompute", "full"], 1),
}
HETEROGENEOUS = {
    "hetero-dense": ("mock-vlm", {**HEAVY, "backend": "te"}, 2, 8, ["--encoder-ranks", "1"], 2),
    "hetero-mid-te": (MID, {**LARGEST_IMAGES, "backend": "te"}, 4, 4,
                      ["--encoder-ranks", "1", "--use-distributed-optimizer"], 2),
}
# issue 48's several-GPU runs (docs/benchmarks/layouts_slice.json) with every image at its largest, so that the
# encoder ranks' peaks are of the batch the estimate describes (the recorded runs drew their images at random)
SLICE = {"hybrid_pattern": "MEMEM*EMEM", "backend": "te", "min_patches": 4096}
SEVERAL = {
    "slice-ep4-largest": ("nemotron-moe-vlm-52l", {**SLICE, "num_experts": 64}, 1, 8,
                          ["--cuda-graphs", "--llm-ep", "4"], 4),
    "slice-split-ep3-largest": ("nemotron-moe-vlm-52l", {**SLICE, "num_experts": 48}, 1, 8,
                                ["--cuda-graphs", "--encoder-ranks", "1", "--llm-ep", "3"], 4),
    "mid-ep4-largest": (MID, {**LARGEST_IMAGES, "backend": "te"}, 4, 2, ["--cuda-graphs", "--llm-ep", "4"], 4),
}
QUICK_CASES = {
    "dense-local": ("mock-vlm", {**QUICK, "backend": "local"}, 2, 2, [], 1),
    "dense-local-full": ("mock-vlm", {**QUICK, "backend": "local"}, 2, 2, ["--recompute", "full"], 1),
    "tiny-local-distopt": ("nemotron-moe-vlm-tiny", {"backend": "local"}, 2, 2, ["--use-distributed-optimizer"], 1),
    "hetero-tiny": ("nemotron-moe-vlm-tiny", {"backend": "local"}, 2, 2, ["--encoder-ranks", "1"], 2),
}


def mimo(args: list[str], log: Path, timeout: float) -> subprocess.CompletedProcess:
    with open(log, "w") as sink:
        return subprocess.run([sys.executable, "-m", "mimo.cli", *args], stdout=sink, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)


def case_args(case, device: str, precision: str) -> list[str]:
    provider, settings, mbs, microbatches, extra, procs = case
    sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    return ["--provider", provider, *sets, "--precision", precision, "--device", device, "--micro-batch-size",
            str(mbs), "--num-microbatches", str(microbatches), "--nproc-per-node", str(procs), *extra]


def run_case(name: str, case, out: Path, device: str, precision: str, iterations: int) -> list[dict]:
    args = case_args(case, device, precision)
    # the estimate: `mimo plan --json` with a limit no case reaches (the comparison, not the refusal, is asked)
    planned = subprocess.run([sys.executable, "-m", "mimo.cli", "plan", *args, "--json", "--gpu-memory", "100000"],
                             capture_output=True, text=True)
    if planned.returncode:
        return [{"case": name, "status": f"plan failed: {planned.stderr.strip()[-300:]}"}]
    estimate = json.loads(planned.stdout)["memory"]
    metrics = out / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    started = time.perf_counter()
    command = ["run", *args, "--train-iters", str(iterations), "--log-interval", "1", "--metrics-file", str(metrics)]
    print(f"== {name}: mimo {shlex.join(command)}", flush=True)
    done = mimo(command, out / f"{name}.log", timeout=900)
    seconds = time.perf_counter() - started
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if done.returncode or not records:
        return [{"case": name, "status": f"run failed (exit {done.returncode}, see {name}.log)", "seconds": seconds}]
    last = records[-1]
    allocated = last.get("peak_memory_gib_ranks") or [last["peak_memory_gib"]]  # CPU: the process's peak RSS
    reserved = last.get("peak_reserved_gib_ranks") or [None] * len(allocated)
    rows = []
    for kind in estimate["ranks"]:
        first, final = kind["ranks"]
        measured = max(allocated[first:final + 1], default=None)  # CPU: the logging rank's RSS only
        rows.append({
            "case": name, "status": "ok", "flags": " ".join(case[4]) or "-", "provider": case[0],
            "backend": case[1].get("backend"), "micro_batch": case[2], "micro_batches": case[3],
            "rank_kind": f"{kind['kind']} {first}-{final}", "estimate_gib": kind["allocated"],
            "estimate_with_allowance_gib": kind["total"], "measured_gib": measured,
            "ratio": kind["allocated"] / measured if measured else None,
            "reserved_gib": max((r for r in reserved[first:final + 1] if r is not None), default=None),
            "terms_gib": {t: kind[t] for t in ("parameters", "gradients", "optimizer", "activations")},
            "seconds": seconds, "command": "mimo " + shlex.join(command),
        })
    return rows


def print_table(rows: list[dict]) -> None:
    def number(value):
        return f"{value:.2f}" if isinstance(value, float) else "-"

    print("| case | flags | rank kind | estimate GiB | measured GiB | ratio | reserved GiB |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['case']} | {r['status']} | | | | | |")
            continue
        print(f"| {r['case']} | {r['flags']} | {r['rank_kind']} | {number(r['estimate_gib'])} | "
              f"{number(r['measured_gib'])} | {number(r['ratio'])} | {number(r['reserved_gib'])} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/memory"))
    parser.add_argument("--cases", nargs="*", default=None,
                        help="case names, 'heterogeneous' for the two-GPU cases or 'several' for the four-GPU ones "
                             "(default: the one-GPU cases)")
    parser.add_argument("--iterations", type=int, default=3, help="iterations per run (the peak settles in 2)")
    parser.add_argument("--quick", action="store_true", help="tiny settings on the CPU: checks the script only")
    args = parser.parse_args()
    known = QUICK_CASES if args.quick else {**CASES, **HETEROGENEOUS, **SEVERAL}
    names = args.cases or list(QUICK_CASES if args.quick else CASES)
    groups = {"heterogeneous": HETEROGENEOUS, "several": SEVERAL}
    if len(names) == 1 and names[0] in groups and not args.quick:
        names = list(groups[names[0]])
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown case {unknown[0]}: choose among {', '.join(known)}, heterogeneous or several")
    device, precision = ("cpu", "fp32") if args.quick else ("cuda", "bf16")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        rows += run_case(name, known[name], args.out, device, precision, args.iterations)
        (args.out / "memory_check.json").write_text(json.dumps(rows, indent=1))
    print_table(rows)
    ok = [r for r in rows if r["status"] == "ok" and r["ratio"] is not None]
    outside = [r for r in ok if not 0.85 <= r["ratio"] <= 1.15]
    print(f"{len(ok)} rank estimates, {len(outside)} outside 0.85-1.15" + ("" if not args.quick else
                                                                         " (quick: CPU RSS, not comparable)"))


if __name__ == "__main__":
    main()
