"""How a workload splits a sample's forward FLOPs between the encoder and the LLM, by the provider's model_flops hook.

    python bench/flop_split.py --out results/flop_split                 # the 52-layer slice's candidate workloads
    python bench/flop_split.py --out /tmp/split --workload "images_per_sample=2 patches_per_image=4096"
    python bench/flop_split.py --out /tmp/smoke --quick                 # the script itself, tiny variant

A heterogeneous layout (encoder on GPUs of its own) balances only where the encoder carries a real share of the work:
several high-resolution images per sample (documents) or many frames (video). Each workload is a set of provider
settings over `--set` (the model); no model is built and nothing runs: the figures are the hook's, which the loop's
TFLOP/s and MFU use too (docs/benchmarks.md, "Workloads where the encoder carries its share").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Results  # noqa: E402

SLICE = ("nemotron-moe-vlm-52l", ["hybrid_pattern=MEMEM*EMEM", "seq_length=8192"])
QUICK = ("nemotron-moe-vlm-tiny", [])
# Documents (several images of exact patch counts) and video (frames in tubelets of 2), around an even split.
CANDIDATES = [
    "", "patches_per_image=4096",
    "images_per_sample=2 patches_per_image=2048", "images_per_sample=4 patches_per_image=2048",
    "images_per_sample=2 patches_per_image=4096", "images_per_sample=3 patches_per_image=4096",
    "images_per_sample=4 min_patches=1024",
    "images_per_sample=0 video_frames=16 video_temporal_patch_size=2 patches_per_image=1024",
    "images_per_sample=0 video_frames=20 video_temporal_patch_size=2 patches_per_image=1024",
    "images_per_sample=1 video_frames=12 video_temporal_patch_size=2 patches_per_image=1024",
]
COLUMNS = [("workload", "workload (--set)", ""), ("encoder_tflop", "encoder TFLOP/sample", ".2f"),
           ("llm_tflop", "LLM TFLOP/sample", ".2f"), ("encoder_share", "encoder share", ".1%")]


def split(provider: str, model: list[str], workload: list[str]) -> dict:
    """One workload's forward FLOPs per sample: the encoders' (every module but the LLM) and the LLM's."""
    from mimo import LANGUAGE
    from mimo.plugins import Registry
    from mimo.plugins.settings import build_settings

    registry = Registry()
    settings = build_settings(registry.get(provider)[0], model + workload)
    flops = registry.hooks(provider).model_flops(settings=settings)
    encoder = sum(v for k, v in flops.items() if k != LANGUAGE)
    return {"workload": " ".join(workload) or "(defaults)", "encoder_tflop": encoder / 1e12,
            "llm_tflop": flops[LANGUAGE] / 1e12, "encoder_share": encoder / (encoder + flops[LANGUAGE])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="the tiny variant: a smoke run of the script")
    parser.add_argument("--provider", help="default: the 52-layer slice (nemotron-moe-vlm-52l, MEMEM*EMEM, 8192)")
    parser.add_argument("--set", dest="model", action="append", default=None, metavar="KEY=VALUE",
                        help="a setting of the model, for every workload (repeatable)")
    parser.add_argument("--workload", action="append", default=None,
                        help="settings of one workload, space-separated (repeatable; default: the candidates)")
    args = parser.parse_args()
    provider, model = QUICK if args.quick else SLICE
    if args.provider:
        provider, model = args.provider, []
    model += args.model or []
    workloads = args.workload or (["", "images_per_sample=3"] if args.quick else CANDIDATES)
    rows = [split(provider, model, w.split()) for w in workloads]
    results = Results("flop_split", COLUMNS, rows=rows)
    results.notes.append(f"{provider} {' '.join(model)}: forward FLOPs per sample (model_flops)")
    results.write(args.out, extra={"provider": provider, "settings": model}, show=True)


if __name__ == "__main__":
    main()
