"""Lane-loader throughput: samples/s and image patches/s for several worker counts.

    python bench/data_loader.py                      # writes a synthetic dataset to a temporary directory
    python bench/data_loader.py --data DIR --workers 1 2 4 8 --mode dynamic --batches 100

One LLM lane reads micro-batches through `mimo.core.data.LaneLoader` (energon workers decode and encode; the
micro-batch is batched in this process, as in training). The first micro-batch (worker start, shuffle buffer
fill) is timed apart from the steady state; each worker decodes a shuffle buffer's worth of samples before its
first one, so time many more samples than workers x buffer for a steady-state figure.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path


def patches_in(batch: dict, mode) -> int:
    encoder_input = batch["modality_inputs"].get("images", {}).get("vit")
    if not encoder_input:
        return 0
    x = encoder_input["x"]
    # fixed tiles: [images, 3, H, W], each image (H/P)^2 patches; dynamic resolution: one [1, patches, C*P*P] pack
    return x.shape[0] * (x.shape[2] // mode.patch_size) * (x.shape[3] // mode.patch_size) if x.ndim == 4 else x.shape[1]


def measure(path: Path, mode, workers: int, micro_batch_size: int, batches: int, seq_length: int,
            shuffle_buffer: int) -> dict:
    from mimo.core.data import ByteTokenizer, LaneLoader, MultimodalTaskEncoder

    encoder = MultimodalTaskEncoder(ByteTokenizer(), seq_length=seq_length, image_mode=mode)
    loader = LaneLoader(path, encoder, micro_batch_size=micro_batch_size, num_lanes=1, num_workers=workers,
                        shuffle_buffer_size=shuffle_buffer or None)
    start = time.perf_counter()
    next(loader)
    first = time.perf_counter() - start
    patches, start = 0, time.perf_counter()
    for _ in range(batches):
        patches += patches_in(next(loader), mode)
    elapsed = time.perf_counter() - start
    loader.close()
    return {"workers": workers, "first_s": first, "samples_s": batches * micro_batch_size / elapsed,
            "patches_s": patches / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="an energon dataset (default: write a synthetic one)")
    parser.add_argument("--num-samples", type=int, default=512, help="samples of the synthetic dataset")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--mode", choices=["tiles", "dynamic"], default="dynamic",
                        help="tiles: 224x224 tiles of 14x14 patches; dynamic: aspect-preserving, 16x16 patches")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=200, help="micro-batches timed after the first")
    parser.add_argument("--shuffle-buffer", type=int, default=100, help="energon's shuffle buffer (0: none)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    from mimo.core.data import DynamicResolution, FixedTiles, write_sample_dataset

    mode = (FixedTiles(image_size=224, patch_size=14) if args.mode == "tiles"
            else DynamicResolution(patch_size=16, min_patches=16, max_patches=256))
    seq_length = 512
    with tempfile.TemporaryDirectory() as scratch:
        path = args.data
        if path is None:
            path = Path(scratch) / "bench"
            write_sample_dataset(path, num_samples=args.num_samples, seed=0, min_size=96, max_size=512,
                                 shard_size=64)
        rows = [measure(path, mode, w, args.micro_batch_size, args.batches, seq_length, args.shuffle_buffer)
                for w in args.workers]
    print(f"\nlane loader, {args.mode} images, micro-batch {args.micro_batch_size}, {args.batches} micro-batches "
          f"timed, shuffle buffer {args.shuffle_buffer}")
    print(f"{'workers':>8} {'first batch s':>14} {'samples/s':>10} {'patches/s':>11}")
    for r in rows:
        print(f"{r['workers']:>8} {r['first_s']:>14.2f} {r['samples_s']:>10.1f} {r['patches_s']:>11.0f}")


if __name__ == "__main__":
    main()
