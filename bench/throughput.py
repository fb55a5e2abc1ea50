"""(a) Throughput on one GPU: tokens/s, TFLOP/s and MFU per GPU, peak memory, and where the GPU time goes.

    python bench/throughput.py --out results/throughput            # on a GPU machine
    python bench/throughput.py --out /tmp/smoke --quick            # the script itself, tiny, on a CPU

Cases (each a `mimo run`, bf16):
  dense        mock-vlm at a GPU-sized setting: a 303M-parameter ViT (448 px, patch 14, 24 layers, hidden 1024) and a
               1.34B-parameter GPT (24 layers, hidden 2048, vocab 32000), sequence 4096 (1024 image tokens),
               torch SDPA attention (flash kernels), micro-batch 2 x 4 micro-batches
  dense-local  the same model with megatron-core's unfused local DotProductAttention, micro-batch 1 x 8
  nemotron-mid nemotron-moe-vlm-mid (RADIO + 20-layer Mamba/MoE/attention LLM, 32 experts top-6), micro-batch 4 x 2

Steady-state figures average the logged intervals after warm-up; the profiled and the FLOP-counted iterations
are left out of them. MFU is against the GPU's dense bf16 peak (989 TFLOP/s on H100/H200).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import Results, bar_plot, mimo_run, profile_notes, settings_args, steady

DENSE = dict(image_size=448, patch_size=14, vision_hidden_size=1024, vision_layers=24, vision_heads=16,
             hidden_size=2048, num_layers=24, num_attention_heads=16, seq_length=4096, vocab_size=32000)
QUICK = dict(image_size=32, patch_size=8, vision_hidden_size=64, vision_layers=2, vision_heads=4, hidden_size=64,
             num_layers=2, num_attention_heads=4, seq_length=128, vocab_size=512)

# name -> (provider, settings, micro-batch size, micro-batches, profile it, check its FLOPs with torch's counter).
# Nemotron's grouped-query attention is not countable by torch's counter (its SDPA formula assumes equal heads).
CASES = {
    "dense": ("mock-vlm", DENSE, 2, 4, True, True),
    "dense-local": ("mock-vlm", {**DENSE, "attention": "local"}, 1, 8, False, False),
    "nemotron-mid": ("nemotron-moe-vlm-mid", {}, 4, 2, True, False),
}
QUICK_CASES = {
    "dense": ("mock-vlm", QUICK, 2, 2, True, True),
    "dense-local": ("mock-vlm", {**QUICK, "attention": "local"}, 1, 4, False, False),
    "nemotron-mid": ("nemotron-moe-vlm-tiny", {}, 2, 2, True, False),
}
ITERATIONS, LOG_INTERVAL = 12, 2
PROFILE = (3, 4)  # profiled iterations: inside the second logged interval, which steady() drops with the first


def case_args(provider: str, settings: dict, mbs: int, microbatches: int, profile: bool, flop_check: bool,
              out: Path, name: str, device: str) -> list[str]:
    args = ["--provider", provider, *settings_args(settings), "--precision", "bf16", "--device", device,
            "--micro-batch-size", str(mbs), "--num-microbatches", str(microbatches),
            "--train-iters", str(ITERATIONS), "--log-interval", str(LOG_INTERVAL)]
    if profile:
        args += ["--profile-dir", str(out / f"profile_{name}"), "--profile-step-start", str(PROFILE[0]),
                 "--profile-step-end", str(PROFILE[1])]
    if flop_check:
        args += ["--flop-check-iteration", str(ITERATIONS)]
    return args


def measure(name: str, case, out: Path, device: str) -> dict:
    provider, settings, mbs, microbatches, profile, flop_check = case
    run = mimo_run(case_args(provider, settings, mbs, microbatches, profile, flop_check, out, name, device), out,
                   name)
    row = {"case": name, "provider": provider, "micro_batch": mbs, "global_batch": mbs * microbatches,
           "settings": settings,
           "status": run.status, "command": run.printed()}
    if run.records:
        # Intervals: [1-2] warm-up, [3-4] profiled, then clean ones; the last holds the FLOP-counted iteration.
        clean = [r for r in run.records
                 if r["iteration"] > PROFILE[1] and not (flop_check and r["iteration"] == ITERATIONS)]
        row.update(steady(clean, warmup_records=0))
        row["lm_loss_last"] = run.records[-1]["lm_loss"]
    for line in run.output.splitlines():
        if line.startswith("FLOP check"):
            row["flop_check"] = line.split("(ratio ")[-1].rstrip(")")
        if line.startswith("mimo run:"):
            row["description"] = line
    summary = out / f"profile_{name}" / "summary_rank0.json"
    if summary.exists():
        import json

        row["profile"] = json.loads(summary.read_text())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/throughput"))
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--quick", action="store_true", help="tiny settings on the CPU: checks the script only")
    args = parser.parse_args()
    cases, device = (QUICK_CASES, "cpu") if args.quick else (CASES, "cuda")

    results = Results("throughput", [
        ("case", "case", ""), ("status", "status", ""), ("global_batch", "global batch", "d"),
        ("elapsed_ms", "ms/iter", ".0f"), ("tokens_per_sec_per_gpu", "tokens/s/GPU", ".0f"),
        ("tflops_per_gpu", "TFLOP/s/GPU", ".1f"), ("mfu", "MFU", ".1%"), ("peak_memory_gib", "peak GiB", ".1f"),
        ("flop_check", "FLOPs model/counted", ""),
    ])
    for name in args.cases:
        results.rows.append(measure(name, cases[name], args.out, device))
    results.notes += profile_notes(results.rows)
    results.write(args.out)
    ok = [r for r in results.rows if r["status"] == "ok"]
    bar_plot(args.out / "throughput.png", [r["case"] for r in ok],
             {"TFLOP/s per GPU": [r.get("tflops_per_gpu") for r in ok]}, "TFLOP/s per GPU (bf16)",
             "mimo throughput, one GPU")


if __name__ == "__main__":
    main()
