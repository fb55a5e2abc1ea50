"""One read sample as `mimo data inspect` and `mimo data preview` see it: its format, turns and images, and, given
the task encoder a provider trains with, what that encoder makes of it (its own `encode_sample`: tokens, loss
mask, each image's patches and tokens by its image mode, the cut to seq_length) or why it skips it.

Nothing of the encoding is done again here: token and image counts come from the encoder and its image mode; a
sample the encoder rejects is classified as the loader classifies it in training (`deferred_errors.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .conversation import Turn
from .deferred_errors import defer_load_errors
from .images import to_float_image
from .sample_formats import conversation_of, kind_of
from .sample_reader import Read
from .skips import UNREADABLE, UNSUPPORTED, SkipRecord, record_of
from .task_encoder import EncodedSample, is_tombstone

__all__ = ["SampleView", "Viewer"]


@dataclass
class SampleView:
    member: int  # which dataset of the blend
    key: str
    shard: str | None
    kind: str | None = None  # captions, vqa, ..., chat (None: it could not be read)
    turns: list[Turn] = field(default_factory=list)
    image_sizes: list[tuple[int, int]] = field(default_factory=list)  # (width, height) in pixels, in slot order
    # with an encoder: per image its patches (None: the image mode does not say) and tokens
    image_patches: list[int | None] = field(default_factory=list)
    image_tokens: list[int] = field(default_factory=list)
    encoded: EncodedSample | None = None  # the encoder's output (cut to seq_length)
    needed_tokens: int | None = None  # the whole sample's tokens (what seq_length would have to be)
    skipped: SkipRecord | None = None

    @property
    def text_tokens(self) -> int | None:
        """The sample's tokens that are not image placeholders (the template's markers included)."""
        return None if self.needed_tokens is None else self.needed_tokens - sum(self.image_tokens)

    @property
    def trained_tokens(self) -> int | None:
        """Tokens the whole sample trains on (answers and documents, before any cut)."""
        return self.encoded.answer_tokens if self.encoded is not None else None


def _pixels(image: Any) -> tuple[int, int]:
    """(width, height) of a decoded image, without converting one that already says it."""
    if isinstance(image, torch.Tensor) and image.ndim == 3 and image.shape[0] in (1, 3, 4):
        return int(image.shape[2]), int(image.shape[1])
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.size
    height, width = to_float_image(image).shape[-2:]
    return int(width), int(height)


def _source(sample) -> tuple[str, str | None]:
    record = record_of(sample, "", "")  # its key and shard, as a skip line names them
    return record.key or "?", record.shard


class Viewer:
    """Makes SampleViews; `encoder`: a provider's task encoder, or None (formats, turns and images only)."""

    def __init__(self, encoder=None):
        self.encoder = encoder
        # the encoder as the lane loader runs it: a sample it rejects comes back as a tombstone saying why
        self._checked = defer_load_errors(encoder) if encoder is not None else None

    def view(self, read: Read) -> SampleView:
        if read.skipped is not None:
            r = read.skipped
            return SampleView(read.member, r.key or "?", r.shard, skipped=r, needed_tokens=r.needed_tokens)
        sample = read.sample
        key, shard = _source(sample)
        view = SampleView(read.member, key, shard, kind=kind_of(sample))
        try:
            conversation = conversation_of(sample)
            view.turns = list(conversation.turns)
            view.image_sizes = [_pixels(image) for image in conversation.images]
        except Exception as err:  # noqa: BLE001 - classified as the loader does: ValueError is content mimo refuses
            view.skipped = record_of(sample, UNSUPPORTED if isinstance(err, ValueError) else UNREADABLE, err)
            return view
        if self.encoder is not None:
            self._encode(view, sample)
        return view

    def _encode(self, view: SampleView, sample) -> None:
        mode = self.encoder.image_mode
        patches = getattr(mode, "num_patches", None)
        view.image_tokens = [mode.num_tokens(h, w) for w, h in view.image_sizes]
        view.image_patches = [patches(h, w) if patches else None for w, h in view.image_sizes]
        encoded = self._checked.encode_sample(sample)
        if is_tombstone(encoded):
            view.skipped = encoded.dropped[0]
            view.needed_tokens = view.skipped.needed_tokens
            return
        view.encoded, view.needed_tokens = encoded, encoded.needed_tokens
