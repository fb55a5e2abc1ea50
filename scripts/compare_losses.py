"""Compare the per-iteration losses of two or more metrics files (from `mimo run --metrics-file`).

    python scripts/compare_losses.py reference.jsonl other.jsonl [more.jsonl ...] [--first N]

Prints one row per iteration and the largest relative difference of each file from the first.
"""

import argparse
import json


def losses(path: str) -> dict[int, float]:
    with open(path) as f:
        return {r["iteration"]: r["lm_loss"] for r in map(json.loads, f)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--first", type=int, default=None, help="compare only the first N iterations")
    args = parser.parse_args()
    runs = [losses(p) for p in args.files]
    iterations = sorted(set.intersection(*(set(r) for r in runs)))[: args.first]
    print("iteration " + " ".join(f"{p[-28:]:>28}" for p in args.files))
    for it in iterations:
        print(f"{it:>9} " + " ".join(f"{r[it]:>28.9f}" for r in runs))
    for path, run in zip(args.files[1:], runs[1:]):
        worst = max(abs(run[it] - runs[0][it]) / abs(runs[0][it]) for it in iterations)
        print(f"max relative difference {path} vs {args.files[0]}: {worst:.3e} over {len(iterations)} iterations")


if __name__ == "__main__":
    main()
