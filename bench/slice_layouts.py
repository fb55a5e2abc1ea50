"""The Nemotron slice on two or four GPUs of one machine, one layout after another in one call: colocated data
parallelism (16 experts), colocated expert parallelism (EP2/EP4 with 32/64 experts: the same experts per GPU, so the
same FLOPs), heterogeneous splits (RADIO on GPU 0 and the LLM on GPU 1; RADIO on 1 or 2 of 4 GPUs), and the whole
model (`full-ep4`: the released LLM with RADIO-H on four GPUs, EP4, full recompute, the distributed precision-aware
optimizer). Rows as docs/benchmarks/layouts_gpu.json keeps them:
tokens/s/GPU and TFLOP/s/GPU min-median-max over the steady iterations, the first iteration's seconds, every
rank's peak memory beside `mimo plan`'s estimate for that rank, and the command.

    python bench/slice_layouts.py --out results/slice_layouts                 # a machine with 2 GPUs
    python bench/slice_layouts.py --layouts colocated-dp4 colocated-ep4 full-ep4 ...   # with 4 GPUs
    python bench/slice_layouts.py --out /tmp/smoke --quick                    # the script itself: tiny, 2 CPU ranks
    python bench/slice_layouts.py --set images_per_sample=2 ...               # provider settings for every layout

The split's run logs per-module timers (--log-timers): the stages' busy time per iteration says whether the
iteration takes the slower stage's time (the stages overlap) or their sum.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common import Results, device_description, mimo_run, settings_args, spread

SLICE = dict(hybrid_pattern="MEMEM*EMEM", num_experts=16, backend="te")
QUICK = dict(backend="local")
# full size: the released LLM's 52 layers and 128 experts with RADIO-H, one 4096-patch image a sample (the memory
# plan's largest image, so its estimate and the measured peak see the same work)
FULL = dict(backend="te", images_per_sample=1, patches_per_image=4096)
FULL_OPTIONS = ("--use-distributed-optimizer", "--recompute", "full")


@dataclass(frozen=True)
class Layout:
    gpus: int
    options: tuple = ()  # `mimo run` options
    settings: dict = field(default_factory=dict)  # over the workload's
    full_size: bool = False  # the whole model (FULL) instead of the slice, without --cuda-graphs
    gpu_options: tuple = ()  # left out by --quick (the CPU refuses them)
    graphs: bool = True  # --cuda-graphs on the slice
    provider: str | None = None  # full size: another release than nemotron-moe-vlm-52l


# Experts scale with expert parallelism where the layout compares against data parallelism (the same experts per GPU,
# so the same FLOPs and GEMM shapes); the splits keep the colocated run's model where they are the advisor's choice.
LAYOUTS = {
    "colocated-dp2": Layout(2),
    "colocated-ep2": Layout(2, ("--llm-ep", "2"), {"num_experts": 32}),
    "split-1+1": Layout(2, ("--encoder-ranks", "1", "--log-timers")),
    # diagnostics: every expert its share of tokens (random routing logits, benchmarks only): what expert
    # parallelism costs without the routing imbalance of untrained weights
    "colocated-dp2-balanced": Layout(2, (), {"moe_router_force_load_balancing": "true"}),
    "colocated-ep2-balanced": Layout(2, ("--llm-ep", "2"), {"num_experts": 32,
                                                             "moe_router_force_load_balancing": "true"}),
    # the routers eager, as they were under expert parallelism before they were graphed there too
    "colocated-ep2-eager-routers": Layout(2, ("--llm-ep", "2"), {"num_experts": 32, "moe_router_graphs": "false"}),
    "colocated-dp4": Layout(4),
    "colocated-ep4": Layout(4, ("--llm-ep", "4"), {"num_experts": 64}),
    "colocated-ep4-overlap": Layout(4, ("--llm-ep", "4", "--overlap-grad-reduce"), {"num_experts": 64}),
    "split-1+3": Layout(4, ("--encoder-ranks", "1", "--log-timers")),
    "split-2+2-ep2": Layout(4, ("--encoder-ranks", "2", "--llm-ep", "2", "--log-timers")),
    # the LLM's context parallelism at 4x the sequence (CUDA graphs are refused with --llm-cp), colocated and with
    # RADIO on a rank of its own
    "colocated-cp2-32k": Layout(2, ("--llm-cp", "2"), {"seq_length": 32768}, graphs=False),
    "split-1+2-cp2-32k": Layout(3, ("--encoder-ranks", "1", "--llm-cp", "2", "--log-timers"), {"seq_length": 32768},
                                graphs=False),
    "full-ep4": Layout(4, ("--llm-ep", "4", *FULL_OPTIONS), full_size=True,
                       gpu_options=("--optimizer-precision", "bf16")),
    # one GPU: LoRA rank 16 on the provider's default targets (routed experts included) against full fine-tuning,
    # and the whole model with adapters at sequence 4096 (issue 50's record)
    "slice-full-finetune": Layout(1, graphs=False),
    "slice-lora16": Layout(1, ("--lora-rank", "16"), graphs=False),
    # adapters with the LLM's layers captured as CUDA graphs, and with its GEMMs in FP8 (issue 50's layouts)
    "slice-lora16-graphs": Layout(1, ("--lora-rank", "16")),
    "slice-lora16-fp8": Layout(1, ("--lora-rank", "16"), gpu_options=("--fp8", "tensorwise"), graphs=False),
    # the routed experts' third adapter layout (fc1's A and fc2's B shared by a layer's experts)
    "slice-lora16-shared-outer": Layout(1, ("--lora-rank", "16", "--lora-experts", "shared-outer"), graphs=False),
    # the 54-layer release at full size, as full-ep4
    "full54-ep4": Layout(4, ("--llm-ep", "4", *FULL_OPTIONS), full_size=True,
                         gpu_options=("--optimizer-precision", "bf16"), provider="nemotron-moe-vlm-54l"),
    "full-lora16": Layout(1, ("--lora-rank", "16"), {"seq_length": 4096}, full_size=True),
}


def layout_line(log: str) -> str:
    """The modules' rank grids from the run's first line (`images: ranks 0-0 TP1 PP1 DP1 | language: ...`)."""
    first = next((line for line in log.splitlines() if line.startswith("mimo run: provider")), "")
    return " | ".join(re.sub(r", [\d,]+ params", "", part.strip()) for part in first.split("|")[1:-2])


def planned_gib(args: list[str]) -> list[dict] | None:
    """`mimo plan --json`'s estimate for the run's options, rank by rank: allocated GiB (what the measured peak
    counts) and total (with the allocator's allowance)."""
    plan = subprocess.run([sys.executable, "-m", "mimo.cli", "plan", *args, "--json"], capture_output=True, text=True)
    if plan.returncode:
        return None
    per_rank = {}
    for group in json.loads(plan.stdout)["memory"]["ranks"]:
        for rank in range(group["ranks"][0], group["ranks"][1] + 1):
            per_rank[rank] = {"allocated": round(group["allocated"], 2), "total": round(group["total"], 2)}
    return [per_rank[r] for r in sorted(per_rank)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/slice_layouts"))
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=6, help="iterations left out of the figures")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    parser.add_argument("--set", action="append", default=[], help="a provider setting for every layout")
    parser.add_argument("--timeout", type=float, default=240, help="seconds one layout may take")
    parser.add_argument("--quick", action="store_true", help="tiny settings on the CPU: checks the script only")
    args = parser.parse_args()
    provider, workload, device, precision, micro, microbatches = (
        ("nemotron-moe-vlm-tiny", QUICK, "cpu", "fp32", 1, 4) if args.quick
        else ("nemotron-moe-vlm-52l", SLICE, "cuda", "bf16", 1, 8))
    extra_settings = dict(item.split("=", 1) for item in args.set)
    results = Results("slice_layouts", [
        ("layout", "layout", ""), ("status", "status", ""), ("ms_per_iter", "ms/iter min-median-max", ""),
        ("tflops", "TFLOP/s/GPU min-median-max", ""), ("first_iteration_s", "first iteration s", ".0f"),
        ("peaks", "peak GiB per rank (plan)", ""), ("timers", "ms per iteration by module", ""),
    ])
    for name in args.layouts:
        layout = LAYOUTS[name]
        base = FULL if layout.full_size and not args.quick else workload
        settings = {**base, **layout.settings, **({} if layout.full_size else extra_settings)}
        common = ["--provider", layout.provider or provider, *settings_args(settings), "--device", device, "--precision", precision,
                  "--nproc-per-node", str(layout.gpus), "--micro-batch-size", str(micro), "--num-microbatches",
                  str(microbatches), *[o for o in layout.options if o != "--log-timers"],
                  *(() if args.quick else layout.gpu_options)]
        if not args.quick and not layout.full_size and layout.graphs:
            common.append("--cuda-graphs")
        options = layout.options
        timers = ["--log-timers"] if "--log-timers" in options else []
        run = mimo_run([*common, *timers, "--train-iters", str(args.iterations), "--log-interval", "1", "--seed", "5"],
                       args.out, name, timeout=args.timeout)
        kept = [r for r in run.records if r.get("split") == "train" and r["iteration"] > args.warmup]
        row = {"layout": name, "grids": layout_line(run.output), "status": run.status, "command": run.printed(),
               "provider": layout.provider or provider, "settings": settings, "gpus": layout.gpus,
               "first_iteration_s": run.to_first_iteration_s}
        for key, short in (("elapsed_ms", "ms_per_iter"), ("tflops_per_gpu", "tflops"),
                           ("tokens_per_sec_per_gpu", "tokens_per_s_per_gpu")):
            row[short + "_spread"] = spread(kept, key)
            if row[short + "_spread"]:
                s = row[short + "_spread"]
                row[short] = f"{s['min']:.0f}-{s['median']:.0f}-{s['max']:.0f}"
        if kept:
            row["peak_memory_gib_ranks"] = kept[-1].get("peak_memory_gib_ranks")
            row["planned_gib_ranks"] = planned_gib(common)
            planned = [p["allocated"] for p in row["planned_gib_ranks"] or []]
            row["peaks"] = (" ".join(f"{m:.1f}" for m in row["peak_memory_gib_ranks"] or [])
                            + f" ({' '.join(f'{p:.1f}' for p in planned)})")
            timers = kept[-1].get("timers_ms")
            if timers:
                row["timers_ms"] = timers
                row["timers"] = "; ".join(f"{module}: " + " ".join(f"{p} {ms:.0f}" for p, ms in phases.items()
                                                                   if ms >= 0.5) for module, phases in timers.items())
        results.rows.append(row)
        results.write(args.out, {"device": device_description(), "workload": workload})  # kept after each layout


if __name__ == "__main__":
    main()
