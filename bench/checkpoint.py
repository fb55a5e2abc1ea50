"""(d) Checkpoint save and load: seconds and GiB/s, with and without `--async-save`.

    python bench/checkpoint.py --out results/checkpoint --dir /local/scratch/ckpt     # one GPU
    python bench/checkpoint.py --out /tmp/smoke --quick                              # the script itself, on a CPU

mock-vlm with a 303M ViT and a 0.74B GPT in bf16 (the optimizer holds fp32 main weights and Adam moments, so a
checkpoint is about 14 bytes per parameter). Each mode trains `--saves` x `--interval` iterations and saves every
`--interval` (the first save also builds dist_checkpointing's save plan; `--keep-last 1` keeps the disk bounded);
then a run resumes from the last checkpoint (loading does not depend on the mode; `--load-both` times it twice).
Give the interval enough iterations for a background write to finish before the next save starts, or the next
save waits for it. Figures come from mimo's own log lines ("saved checkpoint ... in S s
(G GiB, R GiB/s[, training blocked B s])" and "loaded checkpoint ..."); with `--async-save`, the blocked time is
what training waits for (the device-to-host copy and the hand-off) and the total is until the checkpoint is
committed, which is observed at the next iteration boundary after the writer finishes.
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

from common import Results, bar_plot, mimo_run, settings_args, steady

MEDIUM = dict(image_size=448, patch_size=14, vision_hidden_size=1024, vision_layers=24, vision_heads=16,
              hidden_size=2048, num_layers=12, num_attention_heads=16, seq_length=2048, vocab_size=32000)
QUICK = dict(image_size=32, patch_size=8, vision_hidden_size=64, vision_layers=2, vision_heads=4, hidden_size=64,
             num_layers=2, num_attention_heads=4, seq_length=128, vocab_size=512)
LINE = re.compile(r"^(saved|loaded) checkpoint (\S+) in ([\d.]+) s \(([\d.]+) GiB, ([\d.]+) GiB/s"
                  r"(?:, training blocked ([\d.]+) s)?\)")


def parse(output: str) -> list[dict]:
    events = []
    for line in output.splitlines():
        m = LINE.match(line.strip())
        if m:
            events.append({"event": m[1], "directory": m[2], "seconds": float(m[3]), "gib": float(m[4]),
                           "gib_per_s": float(m[5]), "blocked_seconds": float(m[6]) if m[6] else None})
    return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/checkpoint"))
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints are written (default: OUT/ckpt)")
    parser.add_argument("--interval", type=int, default=60, help="iterations between saves")
    parser.add_argument("--saves", type=int, default=2, help="saves per mode")
    parser.add_argument("--load-both", action="store_true", help="time the resume after both modes")
    parser.add_argument("--quick", action="store_true", help="tiny settings on the CPU: checks the script only")
    args = parser.parse_args()
    settings, device, precision = (QUICK, "cpu", "fp32") if args.quick else (MEDIUM, "cuda", "bf16")
    root = args.dir or args.out / "ckpt"
    iterations = args.saves * args.interval
    common = ["--provider", "mock-vlm", *settings_args(settings), "--device", device, "--precision", precision,
              "--micro-batch-size", "2", "--num-microbatches", "2", "--log-interval", "1"]

    results = Results("checkpoint", [
        ("mode", "mode", ""), ("event", "event", ""), ("iteration", "iteration", ""), ("gib", "GiB", ".2f"),
        ("seconds", "seconds", ".2f"), ("gib_per_s", "GiB/s", ".2f"), ("blocked_seconds", "training blocked s", ".2f"),
        ("status", "status", ""),
    ])
    step_ms = {}
    for mode, extra in (("sync", []), ("async", ["--async-save"])):
        directory = root / mode
        shutil.rmtree(directory, ignore_errors=True)
        run = mimo_run([*common, *extra, "--train-iters", str(iterations), "--save", str(directory),
                        "--save-interval", str(args.interval), "--keep-last", "1"], args.out, f"save_{mode}")
        # Iterations right after a save: an async save's writer runs alongside them.
        after = [r for r in run.records if r["iteration"] % args.interval == 1 and r["iteration"] > 1]
        plain = [r for r in run.records if r["iteration"] % args.interval not in (0, 1) and r["iteration"] > 2]
        step_ms[mode] = {"after_save": steady(after, 0).get("elapsed_ms"), "other": steady(plain, 0).get("elapsed_ms")}
        if not parse(run.output):
            results.rows.append({"mode": mode, "event": "save", "status": run.status})
        for event in parse(run.output):
            results.rows.append({"mode": mode, **event, "iteration": int(event["directory"][-7:]),
                                 "status": run.status, "command": run.printed()})
        if mode == "async" and not args.load_both:
            shutil.rmtree(directory, ignore_errors=True)
            continue
        # The same --train-iters: the resumed run loads, finds nothing left to train, and ends.
        resume = mimo_run([*common, *extra, "--train-iters", str(iterations), "--load", str(directory)],
                          args.out, f"load_{mode}")
        for event in parse(resume.output):
            results.rows.append({"mode": mode, **event, "iteration": int(event["directory"][-7:]),
                                 "status": resume.status, "command": resume.printed()})
        if not parse(resume.output):
            results.rows.append({"mode": mode, "event": "load", "status": resume.status})
        shutil.rmtree(directory, ignore_errors=True)
    for mode, ms in step_ms.items():
        if ms["after_save"] and ms["other"]:
            results.notes.append(f"{mode}: the iteration logged after a save (it includes what the save blocked) "
                                 f"{ms['after_save']:.0f} ms, others {ms['other']:.0f} ms")
    results.write(args.out, {"settings": settings, "step_ms": step_ms})
    saves = [r for r in results.rows if r.get("event") in ("saved", "loaded")]
    labels = [f"{r['mode']} {r['event']} {r['iteration']}" for r in saves]
    bar_plot(args.out / "checkpoint.png", labels,
             {"total s": [r["seconds"] for r in saves], "training blocked s": [r["blocked_seconds"] for r in saves]},
             "seconds", "checkpoint save / load time")


if __name__ == "__main__":
    main()
