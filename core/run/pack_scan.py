"""The packs `--data` makes, read before the run: the memory plan's image budget per row from the dataset itself.

Without this the plan counts every packed row full to its image budget (memory/pack_budget.py), the whole row by
default, while a dataset's packs may carry far fewer image tokens: the slice's real-shaped packs carry 3,380 on
average and 6,561 at most of 8,192. So the plan reads the first `--pack-scan-samples` samples of the train split
through the provider's own task encoder and packer (what `mimo data inspect` shows, data/inspection.py), at the
run's packing buffer and the budget being decided, and takes the largest row's image tokens. The plan then counts
that many per row and the run's packer holds every row to it (it becomes the row's image budget), so a pack the
scan did not see, later in the dataset or in another shuffle, still fits what the plan counted: the bound is
enforced, the scan only chooses it. The scan also says the fewest image tokens per row at which the packer makes
no more rows of the samples and skips none (the slice's: 4,416, the same 353 rows), for `--pack-image-tokens`.

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
    image_tokens: int  # the most image tokens of one row, at the budget scanned
    mean_image_tokens: float
    whole: bool  # the split was read to its end
    # the fewest image tokens a row may carry (a multiple of `grain`) for which the packer makes no more rows of
    # these samples and skips none of them: rows as full, the encoders' work per row bounded tighter (said, not
    # taken: no GPU has measured a run at it yet; --pack-image-tokens takes it)
    as_full: int = 0

    def line(self) -> str:
        what = f"all {self.read}" if self.whole else f"the first {self.read}"
        return (f"the largest pack of {what} --data samples: {self.image_tokens}, {self.mean_image_tokens:.0f} on "
                f"average; {self.as_full} pack them as full")


def scan(plan, budget: int, grain: int = 16) -> PackScan | None:
    """The packs of `plan`'s --data with rows of at most `budget` image tokens, and the tightest budget (a multiple
    of `grain`) that packs them as full; None when nothing is scanned (--pack-scan-samples 0) or the data cannot be
    read here (the run's own checks say why)."""
    data = plan.config.data
    if not data.pack_scan_samples:
        return None
    key = json.dumps([str(data.data), plan.config.provider, sorted(vars(plan.settings).items(), key=str), budget,
                      grain, data.packing_buffer_size, data.pack_scan_samples], default=str)
    if key in _CACHE:
        return _CACHE[key]
    handed = json.loads(os.environ.get(ENV) or "{}")
    if handed.get("key") == key:
        found = PackScan(**handed["scan"])
    else:
        try:
            found = _read(plan, budget, data.pack_scan_samples, grain)
        except UsageError:
            return None
        os.environ[ENV] = json.dumps({"key": key, "scan": asdict(found)})  # for the workers mimo starts
    _CACHE[key] = found
    return found


def _read(plan, budget: int, limit: int, grain: int) -> PackScan:
    from mimo.data.inspection import counted
    from mimo.data.sample_reader import SampleReader
    from mimo.data.sample_view import Viewer

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
    rows = _rows(plan, encoder, encoded, budget)
    images = [image_tokens for _, image_tokens in rows]
    largest = max(images, default=0)
    return PackScan(read=read, samples=len(encoded), rows=len(rows), image_tokens=largest,
                    mean_image_tokens=round(sum(images) / len(images), 1) if images else 0.0, whole=whole,
                    as_full=_tightest(plan, encoder, encoded, len(rows), -(-largest // grain) * grain, grain))


def _rows(plan, encoder, encoded: list, budget: int) -> list[tuple[int, int]]:
    """(tokens, image tokens) of the rows the run's packer makes of `encoded` at `budget`, at its packing buffer."""
    from mimo.data.inspection import pack_sizes
    from mimo.plugins.context import packing_buffer_for

    encoder.image_token_budget = budget
    buffer = plan.config.data.packing_buffer_size or packing_buffer_for(encoder.seq_length)
    return pack_sizes(encoder, encoded, buffer)


def _tightest(plan, encoder, encoded: list, rows: int, high: int, grain: int) -> int:
    """The fewest image tokens per row, a multiple of `grain` up to `high` (which packs as full), at which the
    packer makes at most `rows` rows of `encoded` and skips none (a sample whose own images take more is skipped)."""
    own = max((sum(image.num_tokens for image in sample.images) for sample in encoded), default=0)
    low = 0  # packs fuller at high, not at low
    while high - low > grain:
        middle = (low + high) // 2 // grain * grain
        if middle >= own and len(_rows(plan, encoder, encoded, middle)) <= rows:
            high = middle
        else:
            low = middle
    return high


class _Counting:
    """An image mode that counts an image's placeholders as the mode does, without resizing its pixels."""

    def __init__(self, mode):
        self._mode = mode

    def __getattr__(self, name):
        return getattr(self._mode, name)

    def process(self, image):
        from mimo.data.inspection import ImageCount

        return ImageCount(self._mode.num_tokens(image.shape[-2], image.shape[-1]))
