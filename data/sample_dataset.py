"""A small synthetic image-captioning dataset in energon's WebDataset format, for tests and smoke runs.

Every sample is a picture of one coloured shape on a plain background, drawn with PIL, and a caption that names
what is drawn ("a small red circle on a blue background"), so a model can learn the caption from the image. Images
have random sizes and aspect ratios. Samples go into WebDataset tar shards (`<key>.jpg`, `<key>.txt` and a
`<key>.json` with the drawing's parameters), which are then indexed with energon's own preparation API
(`BaseWebdatasetFactory.prepare_dataset`, the function behind `energon prepare`). `energon prepare` writes the
dataset's `.nv-meta/dataset.yaml` itself (there is no API for it), so this module writes that one file the way the
CLI does for `--sample-type CaptioningSample --field-map '{"image": "jpg", "caption": "txt"}'`.

`corrupt_indices` writes undecodable bytes in place of some samples' JPEGs, to exercise the skip-on-error path.
"""

from __future__ import annotations

import io
import json
import math
import random
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import yaml

__all__ = [
    "BACKGROUNDS", "COLORS", "SHAPES", "SampleDatasetInfo", "corrupt_image_bytes", "prepare_energon_dataset",
    "render_sample", "write_sample_dataset",
]

# Colours far apart in RGB, so that JPEG artefacts never make one look like another.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
    "purple": (140, 40, 180),
    "orange": (245, 140, 20),
}
BACKGROUNDS = ("white", "black", "blue", "yellow", "green")
SHAPES = ("circle", "square", "triangle", "cross", "stripes")

# energon's CLI: `energon prepare PATH --non-interactive --split-ratio 1,0,0 --sample-type CaptioningSample
# --field-map '{"image": "jpg", "caption": "txt"}'` writes exactly this dict with `yaml.dump(..., sort_keys=False)`.
CAPTIONING_FIELD_MAP = {"image": "jpg", "caption": "txt"}


@dataclass(frozen=True)
class SampleDatasetInfo:
    path: Path
    num_samples: int
    shards: list[str]  # tar file names relative to `path`
    corrupt_keys: list[str]  # sample keys whose image bytes cannot be decoded
    splits: dict[str, list[str]]  # split part -> shard names
    samples: dict[str, dict]  # key -> what was drawn: caption, width, height, shape, color, ... (corrupt: True)


def _draw_shape(draw, shape: str, box: tuple[int, int, int, int], fill: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    w, h = x1 - x0, y1 - y0
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(x0 + w / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    elif shape == "cross":
        tw, th = max(1, w // 4), max(1, h // 4)
        draw.rectangle((x0 + (w - tw) // 2, y0, x0 + (w + tw) // 2, y1), fill=fill)
        draw.rectangle((x0, y0 + (h - th) // 2, x1, y0 + (h + th) // 2), fill=fill)
    elif shape == "stripes":
        n = 3
        for k in range(n):
            sx0 = x0 + k * w * 2 // (2 * n - 1)
            draw.rectangle((sx0, y0, sx0 + max(1, w // (2 * n - 1)), y1), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def render_sample(rng: random.Random, min_size: int, max_size: int, quality: int = 90) -> tuple[bytes, str, dict]:
    """Draw one sample: (JPEG bytes, caption, metadata). Width and height are drawn independently."""
    from PIL import Image, ImageDraw

    width, height = rng.randint(min_size, max_size), rng.randint(min_size, max_size)
    shape = rng.choice(SHAPES)
    color = rng.choice(list(COLORS))
    background = rng.choice([b for b in BACKGROUNDS if b != color])
    size = rng.choice(("small", "large"))
    image = Image.new("RGB", (width, height), COLORS[background])
    short = min(width, height)
    extent = int(short * (0.35 if size == "small" else 0.8))
    extent = max(extent, 4)
    cx = rng.randint(extent // 2, width - (extent + 1) // 2)
    cy = rng.randint(extent // 2, height - (extent + 1) // 2)
    box = (cx - extent // 2, cy - extent // 2, cx - extent // 2 + extent - 1, cy - extent // 2 + extent - 1)
    _draw_shape(ImageDraw.Draw(image), shape, box, COLORS[color])
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    caption = f"a {size} {color} {shape} on a {background} background"
    meta = dict(width=width, height=height, shape=shape, color=color, background=background, size=size)
    return buf.getvalue(), caption, meta


def corrupt_image_bytes(rng: random.Random, length: int = 256) -> bytes:
    """Bytes that no image decoder accepts (no known magic number, no valid structure)."""
    return b"CORRUPT-NOT-AN-IMAGE\x00" + bytes(rng.getrandbits(8) for _ in range(length))


def _add_file(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = 0  # reproducible shards
    tar.addfile(info, io.BytesIO(data))


def prepare_energon_dataset(
    path: str | Path,
    shards: Sequence[str],
    *,
    split_parts_patterns: Iterable[tuple[str, str]] | None = None,
    field_map: dict[str, str] | None = None,
    workers: int = 1,
) -> None:
    """Index existing tar shards with energon's preparation API and write the captioning `dataset.yaml`.

    `BaseWebdatasetFactory.prepare_dataset` writes `.nv-meta/index.sqlite`, `index.uuid`, `.info.json`,
    `split.yaml` and each shard's `.tar.idx`. The `dataset.yaml` is what `energon prepare` writes for a
    CaptioningSample with a field map. By default every shard goes into the "train" split and val/test are empty
    (energon's ratio-based split rounds per shard, which would leave a tiny dataset's train split empty).
    """
    from megatron.energon.flavors.webdataset import BaseWebdatasetFactory
    from megatron.energon.flavors.webdataset.config import MAIN_FOLDER_NAME

    root = Path(path)
    if split_parts_patterns is None:
        split_parts_patterns = [("train", ".*"), ("val", "^$"), ("test", "^$")]
    BaseWebdatasetFactory.prepare_dataset(
        root,
        list(shards),
        split_parts_patterns=list(split_parts_patterns),
        shuffle_seed=None,
        workers=max(1, workers),
    )
    dataset_definition = {
        "sample_type": {"__module__": "megatron.energon", "__class__": "CaptioningSample"},
        "field_map": dict(field_map or CAPTIONING_FIELD_MAP),
    }
    with open(root / MAIN_FOLDER_NAME / "dataset.yaml", "w") as f:
        yaml.dump(dataset_definition, f, sort_keys=False)


def write_sample_dataset(
    path: str | Path,
    num_samples: int = 64,
    seed: int = 0,
    min_size: int = 24,
    max_size: int = 96,
    shard_size: int = 16,
    corrupt_indices: Iterable[int] = (),
    jpeg_quality: int = 90,
    prepare: bool = True,
    val_shards: int = 0,
) -> SampleDatasetInfo:
    """Write `num_samples` synthetic captioned images as WebDataset shards under `path` and prepare them for energon.

    Sample `i` has key `sample_{i:06d}` and lies in shard `shard_{i // shard_size:04d}.tar`. The samples in
    `corrupt_indices` get undecodable bytes as their `.jpg` (their caption and json stay valid). With `prepare`, the
    dataset is indexed so that `megatron.energon.get_train_dataset(path, ...)` loads it as CaptioningSamples.
    The last `val_shards` shards form the "val" split, the others "train". Deterministic in `seed`.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not 8 <= min_size <= max_size:
        raise ValueError(f"need 8 <= min_size <= max_size, got {min_size}, {max_size}")
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    corrupt = sorted(set(int(i) for i in corrupt_indices))
    bad = [i for i in corrupt if not 0 <= i < num_samples]
    if bad:
        raise ValueError(f"corrupt_indices {bad} out of range for {num_samples} samples")

    if not 0 <= val_shards < math.ceil(num_samples / shard_size):
        raise ValueError(f"val_shards={val_shards} must leave at least one of the "
                         f"{math.ceil(num_samples / shard_size)} shards for training")

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    shards: list[str] = []
    corrupt_keys: list[str] = []
    samples: dict[str, dict] = {}
    num_shards = math.ceil(num_samples / shard_size)
    for s in range(num_shards):
        name = f"shard_{s:04d}.tar"
        shards.append(name)
        with tarfile.open(root / name, "w") as tar:
            for i in range(s * shard_size, min(num_samples, (s + 1) * shard_size)):
                key = f"sample_{i:06d}"
                jpg, caption, meta = render_sample(rng, min_size, max_size, jpeg_quality)
                if i in corrupt:
                    jpg = corrupt_image_bytes(rng)
                    meta["corrupt"] = True
                    corrupt_keys.append(key)
                samples[key] = dict(meta, caption=caption)
                _add_file(tar, f"{key}.jpg", jpg)
                _add_file(tar, f"{key}.txt", caption.encode("utf-8"))
                _add_file(tar, f"{key}.json", json.dumps(meta, sort_keys=True).encode("utf-8"))

    val = shards[len(shards) - val_shards:] if val_shards else []
    train = [s for s in shards if s not in val]
    splits = {"train": train, "val": val, "test": []}
    if prepare:
        patterns = [(part, "^(" + "|".join(re.escape(n) for n in names) + ")$" if names else "^$")
                    for part, names in splits.items()]
        prepare_energon_dataset(root, shards, split_parts_patterns=patterns)
    return SampleDatasetInfo(path=root, num_samples=num_samples, shards=shards, corrupt_keys=corrupt_keys,
                             splits=splits, samples=samples)
