"""The memory plan of today beside peaks measured before: for each row of bench/real_data.py's JSON files, `mimo
plan` with the row's options (here, for the GPU it ran on: --device cuda --gpu-memory), its allocated estimate (the
total less the allowance) beside the row's measured peak and the plan the row was run with.

    python bench/plan_vs_peak.py results/real_data/*.json --gpu-memory 140.4 --data results/real/dataset

`--data` replaces the rows' dataset path (the dataset the GPU read, made again here by bench/real_shaped_data.py
with the same seed). A plan that is right stays at or above every peak, and within a few percent of it.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from common import plan_json

LOOP_ONLY = {"--train-iters", "--log-interval", "--metrics-file", "--memory-snapshot-dir",
             "--memory-snapshot-iteration", "--tensorboard-dir"}


def plan_options(command: str, data: str | None, gpu_memory: float, scan: int = 2000) -> list[str]:
    """The `mimo run` command's options that `mimo plan` takes, the device and the GPU's memory set, and with
    --data the plan's scan of the dataset's packs (`--pack-scan-samples scan`)."""
    words, kept = shlex.split(command)[2:], []  # after `mimo run`
    while words:
        word = words.pop(0)
        if word in LOOP_ONLY or word in ("--device", "--gpu-memory") or (word == "--data" and data):
            words.pop(0)
            continue
        kept.append(word)
    packed = data and "--data" in command
    return kept + ["--device", "cuda", "--gpu-memory", str(gpu_memory)] + (
        ["--data", data, "--pack-scan-samples", str(scan)] if packed else [])


def plan_now(options: list[str]) -> dict:
    plan, failure = plan_json(options)
    if plan is None:
        return {"error": [failure]}
    return {"allocated": plan["largest"]["allocated"], "total": plan["largest"]["total"], "packs": plan["packs"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="bench/real_data.py JSON files")
    parser.add_argument("--gpu-memory", type=float, required=True, help="the GPU's memory the rows ran on, GiB")
    parser.add_argument("--data", help="the rows' --data, made again here")
    args = parser.parse_args()
    print(f"{'case':<18} {'peak':>6} {'plan then':>9} {'plan now':>8} {'peak/plan':>9}  packs")
    for path in args.files:
        for row in json.loads(path.read_text())["rows"]:
            if row.get("peak_memory_gib") is None:
                continue
            now = plan_now(plan_options(row["command"], args.data, args.gpu_memory))
            if "error" in now:
                print(f"{row['case']:<18} plan refused: {' '.join(now['error'])}")
                continue
            then = row.get("plan_allocated_gib")
            print(f"{row['case']:<18} {row['peak_memory_gib']:>6.1f} {then or float('nan'):>9.1f} "
                  f"{now['allocated']:>8.1f} {row['peak_memory_gib'] / now['allocated']:>9.1%}  {now['packs'] or '-'}")


if __name__ == "__main__":
    main()
