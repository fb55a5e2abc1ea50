"""Qwen3.5's 3-D (multimodal RoPE) positions of one sample, as transformers' `get_rope_index` computes them.

Each token has a (temporal, height, width) position. Text tokens have the same value on all three axes, counting
on from the previous token. An image's placeholders (its merged tokens, row-major over the grid of LLM tokens
`(t, h, w)` = the tower's grid with h and w divided by the merge size) take `start + (frame, row, column)` where
`start` is the position the next text token would have had; after the image the text goes on from `start +
max(h, w)`. Packed rows restart the positions per sample: each sample's positions are computed alone
(`MRoPEPositions` is the hook the task encoder calls per sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def mrope_positions(tokens: torch.Tensor, image_token_id: int, grids: Sequence[Sequence[int]]) -> torch.Tensor:
    """`tokens` [L] of one sample, the LLM grids `(t, h, w)` of its images in placeholder order -> positions
    [3, L] (long). Each image's run of placeholders must be exactly `t * h * w` long (ValueError otherwise)."""
    tokens = torch.as_tensor(tokens)
    length = tokens.shape[-1]
    out = torch.empty(3, length, dtype=torch.long)
    image_at = (tokens == image_token_id).nonzero().flatten().tolist()
    i, current, next_image, g = 0, 0, 0, 0
    while i < length:
        while next_image < len(image_at) and image_at[next_image] < i:
            next_image += 1
        start = image_at[next_image] if next_image < len(image_at) else length
        if start > i:  # text up to the next image
            out[:, i:start] = torch.arange(current, current + start - i)
            current += start - i
            i = start
            continue
        if g >= len(grids):
            raise ValueError(f"the sample has more image placeholders (id {image_token_id}) than its "
                             f"{len(grids)} images take")
        t, h, w = (int(v) for v in grids[g])
        n = t * h * w
        if i + n > length or not bool((tokens[i:i + n] == image_token_id).all()):
            raise ValueError(f"image {g} (grid {t}x{h}x{w}) needs {n} consecutive placeholders at token {i}")
        frame = torch.arange(t).view(t, 1, 1).expand(t, h, w).flatten()
        row = torch.arange(h).view(1, h, 1).expand(t, h, w).flatten()
        col = torch.arange(w).view(1, 1, w).expand(t, h, w).flatten()
        out[:, i:i + n] = current + torch.stack([frame, row, col])
        current += max(h, w)
        i += n
        g += 1
    if g != len(grids):
        raise ValueError(f"the sample's placeholders hold {g} of its {len(grids)} images")
    return out


@dataclass(frozen=True)
class MRoPEPositions:
    """The task encoder's hook (`MultimodalTaskEncoder(positions=...)`): a sample's tokens and processed images
    (GridImage, with `grid_thw` in patches) -> its [3, L] positions."""

    image_token_id: int
    merge_size: int

    def __call__(self, tokens: torch.Tensor, images: Sequence) -> torch.Tensor:
        m = self.merge_size
        return mrope_positions(tokens, self.image_token_id, [(t, h // m, w // m) for t, h, w in
                                                             (im.grid_thw for im in images)])
