"""(b) Two GPUs: the encoder on one GPU and the LLM on the other (heterogeneous, the multimodule 1F1B pipeline over
the bridge) against both modules on both GPUs (colocated data parallelism), same model and global batch.

    python bench/layouts.py --out results/layouts                   # a machine with 2 GPUs
    python bench/layouts.py --out /tmp/smoke --quick                # the script itself, tiny, 2 CPU processes
    python bench/layouts.py --out results/shared --shared           # issue 63: separate layouts on shared GPUs

The model is chosen so the encoder is a real share of the compute: mock-vlm with a 630M-parameter ViT (448 px,
patch 14, 32 layers, hidden 1280; 1024 image tokens) and a 0.54B-parameter GPT (8 layers, hidden 2048, vocab 32000),
sequence 2048, bf16, micro-batch 2, global batch 16. Each layout runs twice: once for throughput, once with
`--log-timers` for per-module phase times (the timers synchronize the GPU at phase boundaries, so that run's
step time is not the throughput figure).

`--shared` (issue 63, item 3): a workload whose LLM runs TP2, both modules on both GPUs, in one layout (the encoder at
TP2 too, `--encoder-tp 2`) against separate layouts on the same GPUs (the encoder at TP1, data-parallel over both,
beside the LLM's TP2: `--encoder-tp 1`). `SHARED_TP2`: a ViT-H-class encoder at 4096 patches a sample (896 px,
patch 14, 32 layers, hidden 1280) and an 8-layer GPT at the 27B class's width (hidden 5120), sequence 8192. The
target: separate at >= 1.2x the single layout's tokens/s/GPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import Results, bar_plot, mimo_run, settings_args, steady

ENCODER_HEAVY = dict(image_size=448, patch_size=14, vision_hidden_size=1280, vision_layers=32, vision_heads=16,
                     hidden_size=2048, num_layers=8, num_attention_heads=16, seq_length=2048, vocab_size=32000)
QUICK = dict(image_size=32, patch_size=8, vision_hidden_size=64, vision_layers=2, vision_heads=4, hidden_size=64,
             num_layers=2, num_attention_heads=4, seq_length=128, vocab_size=512)
LAYOUTS = {"heterogeneous": ["--encoder-ranks", "1"], "colocated": []}
SHARED_TP2 = dict(image_size=896, patch_size=14, vision_hidden_size=1280, vision_layers=32, vision_heads=16,
                  hidden_size=5120, num_layers=8, num_attention_heads=40, seq_length=8192, vocab_size=32000)
SHARED_QUICK = dict(QUICK, seq_length=256)
SHARED_LAYOUTS = {"single-tp2": ["--llm-tp", "2", "--encoder-tp", "2"],
                  "separate-encoder-tp1": ["--llm-tp", "2", "--encoder-tp", "1"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/layouts"))
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="tiny settings on the CPU: checks the script only")
    parser.add_argument("--shared", action="store_true", help="one layout against separate layouts on shared GPUs")
    args = parser.parse_args()
    device, precision = ("cpu", "fp32") if args.quick else ("cuda", "bf16")
    if args.shared:
        settings, layouts, batch = (SHARED_QUICK if args.quick else SHARED_TP2), SHARED_LAYOUTS, ["2", "16"]
    else:
        settings, layouts, batch = (QUICK if args.quick else ENCODER_HEAVY), LAYOUTS, ["2", "16"]
    common = ["--provider", "mock-vlm", *settings_args(settings), "--device", device, "--precision", precision,
              "--nproc-per-node", "2", "--micro-batch-size", batch[0], "--global-batch-size", batch[1],
              "--log-interval", "4"]

    results = Results("layouts", [
        ("layout", "layout", ""), ("status", "status", ""), ("elapsed_ms", "ms/iter", ".0f"),
        ("tokens_per_sec_per_gpu", "tokens/s/GPU", ".0f"), ("tflops_per_gpu", "TFLOP/s/GPU", ".1f"),
        ("mfu", "MFU", ".1%"), ("peak_memory_gib", "peak GiB", ".1f"), ("timers", "ms per iteration (timed run)", ""),
    ])
    for layout, extra in layouts.items():
        run = mimo_run([*common, *extra, "--train-iters", str(args.iterations)], args.out, layout)
        row = {"layout": layout, "status": run.status, "command": run.printed(), **steady(run.records)}
        timed = mimo_run([*common, *extra, "--train-iters", "8", "--log-timers"], args.out, f"{layout}_timers")
        if timed.records and "timers_ms" in timed.records[-1]:
            row["timers_ms"] = timed.records[-1]["timers_ms"]
            row["timed_elapsed_ms"] = timed.records[-1]["elapsed_ms"]
            row["timers"] = "; ".join(f"{module}: " + " ".join(f"{p} {ms:.0f}" for p, ms in phases.items() if ms >= 0.5)
                                      for module, phases in row["timers_ms"].items())
            row["timed_command"] = timed.printed()
        results.rows.append(row)
    done = {r["layout"]: r for r in results.rows if r.get("elapsed_ms")}
    if len(done) == 2:
        first, second = list(layouts)
        speedup = done[first]["elapsed_ms"] / done[second]["elapsed_ms"]
        results.notes.append(f"{second} / {first} throughput: {speedup:.3f}")
    results.write(args.out, {"settings": settings})
    if args.shared:
        return
    bar_plot(args.out / "layouts.png", list(done), {"tokens/s per GPU": [r["tokens_per_sec_per_gpu"] for r in done.values()]},
             "tokens/s per GPU", "encoder on GPU 0 + LLM on GPU 1 vs colocated DP 2")


if __name__ == "__main__":
    main()
