"""What the graphed encoder's token bucket trades: padded patches every step against CUDA-graph captures.

    python bench/encoder_buckets.py --out results/encoder_buckets                  # the slice, 300 steps
    python bench/encoder_buckets.py --out /tmp/smoke --quick                        # the script itself, small

Nemotron's recomputed RADIO forward replays one CUDA graph per bucket of a step's packed patches
(`mimo.plugins.kit.recompute_graphs`): the patches plus one padding sequence fill the next multiple of
`token_bucket`, and each bucket seen for the first time costs an eager forward and a capture (0.12-0.31 s on an
H100, docs/benchmarks.md (g)). Smaller buckets pad less (the padding runs through every layer, forward and
recompute) but capture more often. This counts both, on the CPU, for the images the provider's synthetic data
gives a run's steps (the same seed and order as `mimo run`): the padding's share of the encoder's tokens and the
steps that capture, within the warm-up, in the measured window and after it. No model runs: the figures are
exact for that data, and bench/te_path.py's logged capture iterations are what the default bucket predicts here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results  # noqa: E402

# the recorded slice runs (docs/benchmarks/slice_h100.json) predate the omni processor's grid rule
SLICE = ("nemotron-moe-vlm-52l", {"hybrid_pattern": "MEMEM*EMEM", "num_experts": 16, "backend": "te",
                                  "image_grid": "closest"}, 8)
QUICK = ("nemotron-moe-vlm-tiny", {}, 4)
COLUMNS = [("token_bucket", "token bucket", "d"), ("padding_share", "padding / patches", ".1%"),
           ("captures_in_warmup", "captures in warm-up", "d"), ("captures_in_window", "in the window", "d"),
           ("captures_after", "after it", "d"), ("buckets", "buckets", "d")]


def step_lengths(provider: str, assignments: dict, images_per_step: int, steps: int, seed: int) -> list[list[int]]:
    """Each step's packed sequence lengths (patches + class tokens per image or video tubelet), as RADIO hands
    them over."""
    from mimo.plugins import Registry
    from mimo.plugins.data import clip_tubelets
    from mimo.plugins.settings import build_settings
    from mimo.providers.nemotron.data import SyntheticTask

    settings = build_settings(Registry().get(provider)[0], [f"{k}={v}" for k, v in assignments.items()])
    task = SyntheticTask(settings)
    out = []
    for step in range(steps):
        lengths = []
        for index in range(step * images_per_step, (step + 1) * images_per_step):
            for frames in task.clip_sizes(seed, index):
                rows, cols = task.mode.grid(*frames[0])
                tubelets = clip_tubelets(len(frames), settings.video_temporal_patch_size)
                lengths += [rows * cols + settings.class_tokens] * tubelets
        out.append(lengths)
    return out


def bucket_figures(steps: list[list[int]], token_bucket: int, warmup: int, window_end: int) -> dict:
    """Padding share and capture steps (1-based) of one token bucket (the other buckets RecomputeGraphs' defaults),
    as RecomputeGraphs keys its graphs."""
    from mimo.plugins.kit.recompute_graphs import SEQLEN_BUCKET, SEQUENCE_BUCKET, bucket_key, padded_lengths

    seen, captures, padding, patches = set(), [], 0, 0
    for step, lengths in enumerate(steps, 1):
        if not lengths:
            continue
        padded = padded_lengths(lengths, token_bucket, SEQUENCE_BUCKET)
        key = bucket_key(padded, SEQLEN_BUCKET)
        if key not in seen:
            seen.add(key)
            captures.append(step)
        padding += sum(padded) - sum(lengths)
        patches += sum(lengths)
    return {"token_bucket": token_bucket, "padding_share": padding / patches, "buckets": len(seen),
            "capture_steps": captures,
            "captures_in_warmup": sum(step <= warmup for step in captures),
            "captures_in_window": sum(warmup < step <= window_end for step in captures),
            "captures_after": sum(step > window_end for step in captures)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="the tiny variant: a smoke run of the script")
    parser.add_argument("--buckets", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--steps", type=int, default=300, help="steps counted (captures after the window too)")
    parser.add_argument("--warmup", type=int, default=12, help="bench/te_path.py's warm-up iterations")
    parser.add_argument("--window-end", type=int, default=40, help="the last iteration of te_path's window")
    parser.add_argument("--seed", type=int, default=1234, help="mimo run's --seed")
    args = parser.parse_args()
    provider, assignments, images_per_step = QUICK if args.quick else SLICE
    steps = step_lengths(provider, assignments, images_per_step, args.steps, args.seed)
    rows = [bucket_figures(steps, bucket, args.warmup, args.window_end) for bucket in args.buckets]
    results = Results("encoder_buckets", COLUMNS, rows=rows)
    results.notes.append(f"{provider} {json.dumps(assignments)}: {images_per_step} images a step, {args.steps} "
                         f"steps, te_path's window {args.warmup + 1}-{args.window_end}")
    results.write(args.out, extra={"provider": provider, "settings": assignments, "images_per_step": images_per_step,
                                   "steps": args.steps, "warmup": args.warmup, "window_end": args.window_end,
                                   "seed": args.seed, "patches_per_step": sum(map(sum, steps)) / len(steps)})


if __name__ == "__main__":
    main()
