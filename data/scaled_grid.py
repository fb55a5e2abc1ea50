"""The patch grid of the Nemotron omni model's image processor: the image's own grid, scaled as a whole into the
patch budget, each side then rounded to a multiple of the pixel-shuffle side.

A model exported to Hugging Face is run with that processor; training with the same grids keeps the exported
model's prompts (the number of image tokens) and pixels those mimo trained and generates with. It differs from
`images.fit_patch_grid` (which searches for the grid closest in aspect ratio and patch count) for some sizes:
an image 40 pixels high and 80 wide (16-pixel patches, 16 to 64 of them) gets 4x6 patches here, 2x8 there.
"""

from __future__ import annotations

import math

__all__ = ["scaled_patch_grid"]


def scaled_patch_grid(height: int, width: int, patch_size: int, min_patches: int, max_patches: int,
                      step: int = 1) -> tuple[int, int]:
    """`(h_patches, w_patches)` for an image of `height` x `width` pixels, as the omni processor chooses it."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    # The processor's rounding, kept exactly for parity: round() halves to even, so a side of an odd number of
    # whole patches gets one patch more, an even number none, and a side with a partial patch is rounded up.
    rows, cols = round(height / patch_size + 0.5), round(width / patch_size + 0.5)

    shrink = min(math.sqrt(max_patches / (rows * cols)), 1.0)
    # A side floored to 0 (an aspect ratio beyond max_patches:1) makes the processor divide by zero; one patch
    # keeps such an image defined here.
    rows, cols = max(math.floor(shrink * rows), 1), max(math.floor(shrink * cols), 1)

    if max_patches > min_patches and rows * cols < min_patches:
        grow = math.sqrt(min_patches / (rows * cols))
        rows, cols = math.ceil(grow * rows), math.ceil(grow * cols)

    # Rows first, then columns: up to the next multiple of `step` while the budget allows, else down (never
    # below one step).
    if rows % step:
        up = rows + step - rows % step
        rows = up if up * cols <= max_patches else max(step, rows - rows % step)
    if cols % step:
        up = cols + step - cols % step
        cols = up if rows * up <= max_patches else max(step, cols - cols % step)
    return rows, cols
