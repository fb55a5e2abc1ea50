"""The packs `--data` makes, read before the run: the memory plan's image budget per row from the dataset itself.

Without this the plan counts every packed row full to its image budget (memory/pack_budget.py), the whole row by
default, while a dataset's packs may carry far fewer image tokens: the slice's real-shaped packs carry 3,380 on
average and 6,561 at most of 8,192. So the plan reads the first `--pack-scan-samples` samples of the train split
through the provider's own task encoder and packer (what `mimo data inspect` shows, data/inspection.py), at the
run's packing buffer and the budget being decided, and takes the largest row's image tokens. The plan then counts
that many per row and the run's packer holds every row to it (it becomes the row's image budget), so a pack the
scan did not see, later in the dataset or in another shuffle, still fits what the plan counted: the bound is
enforced, the scan only chooses it.

Deterministic: every rank reads the same first samples and gets the same figure; mimo's launcher hands it to its
workers (the `MIMO_PACK_SCAN` environment variable) so they do not read them again.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from mimo.errors import UsageError

__all__ = ["PackScan", "scan"]

ENV = "MIMO_PACK_SCAN"
_CACHE: dict[str, "PackScan"] = {}


@dataclass(frozen=True)
class PackScan:
    """What the packer made of the samples scanned."""

    read: int  # samples read
    samples: int  # of them encoded (the rest skipped as the run would skip them)
    rows: int
    image_tokens: int  # the most image tokens of one row
    mean_image_tokens: float
    whole: bool  # the split was read to its end

    def line(self) -> str:
        what = f"all {self.read}" if self.whole else f"the first {self.read}"
        return (f"the largest pack of {what} --data samples: {self.image_tokens}, "
                f"{self.mean_image_tokens:.0f} on average")


def scan(plan, budget: int) -> PackScan | None:
    """The packs of `plan`'s --data with rows of at most `budget` image tokens; None when nothing is scanned
    (--pack-scan-samples 0) or the data cannot be read here (the run's own checks say why)."""
    data = plan.config.data
    if not data.pack_scan_samples:
        return None
    key = json.dumps([str(data.data), plan.config.provider, sorted(vars(plan.settings).items(), key=str), budget,
                      data.packing_buffer_size, data.pack_scan_samples], default=str)
    if key in _CACHE:
        return _CACHE[key]
    handed = json.loads(os.environ.get(ENV) or "{}")
    if handed.get("key") == key:
        found = PackScan(**handed["scan"])
    else:
        try:
            found = _read(plan, budget, data.pack_scan_samples)
        except UsageError:
            return None
        os.environ[ENV] = json.dumps({"key": key, "scan": asdict(found)})  # for the workers mimo starts
    _CACHE[key] = found
    return found


def _read(plan, budget: int, limit: int) -> PackScan:
    from mimo.data.inspection import counted, pack_sizes
    from mimo.data.sample_reader import SampleReader
    from mimo.data.sample_view import Viewer
    from mimo.plugins.context import packing_buffer_for

    from .data_encoder import provider_encoder

    found = provider_encoder(plan.config)
    encoder = found.encoder
    encoder.image_token_budget = budget
    if getattr(encoder, "positions", None) is None:  # nothing of the encoding reads the pixels: only count them
        encoder.image_mode = _Counting(encoder.image_mode)
    reader = SampleReader(plan.config.data.data, "train", encoder, f"provider '{found.provider}'", "--data")
    viewer = Viewer(encoder)
    encoded, read, whole = [], 0, True
    for item in reader:
        if read >= limit:
            whole = False
            break
        read += 1
        view = viewer.view(item)
        if view.encoded is not None:
            encoded.append(counted(view.encoded))
    buffer = plan.config.data.packing_buffer_size or packing_buffer_for(encoder.seq_length)
    images = [image_tokens for _, image_tokens in pack_sizes(encoder, encoded, buffer)]
    return PackScan(read=read, samples=len(encoded), rows=len(images), image_tokens=max(images, default=0),
                    mean_image_tokens=round(sum(images) / len(images), 1) if images else 0.0, whole=whole)


class _Counting:
    """An image mode that counts an image's placeholders as the mode does, without resizing its pixels."""

    def __init__(self, mode):
        self._mode = mode

    def __getattr__(self, name):
        return getattr(self._mode, name)

    def process(self, image):
        from mimo.data.inspection import ImageCount

        return ImageCount(self._mode.num_tokens(image.shape[-2], image.shape[-1]))
