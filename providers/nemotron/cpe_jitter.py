"""RADIO's jittered position embeddings (CPE augmentation in training) as two matrix products.

In training, megatron-core's RADIOViTModel samples each image's position embeddings from its table (max rows x max
cols x hidden) at a random window: a scale, an aspect ratio and an offset per image, the sample points a grid
that is a product of one row coordinate per output row and one column coordinate per output column, read with
`F.grid_sample` (bilinear). Its backward scatters with atomic adds into the fp32 table, image by image: 15 ms an
iteration of the Nemotron slice on an H100 (8 images), 1.4% of the step. Bilinear weights on such a grid are
separable, so the same sample is `Wy @ table @ Wx^T` with two sparse-as-dense weight matrices (two taps per row),
and its backward is two GEMMs. Same random draws in the same order as megatron-core, same coordinates (the same
fp32 operations), the same zero padding outside the table; the sums run in another order (fp32 rounding).
"""

from __future__ import annotations

import math

import torch


def _tap_weights(coords: torch.Tensor, size: int, align_corners: bool) -> torch.Tensor:
    """`coords [b, n]` in [-1, 1] (grid_sample's normalized coordinates) -> bilinear weights `[b, n, size]`: each
    point's two neighbours, those outside `[0, size)` left out (zero padding)."""
    if align_corners:  # grid_sample's unnormalization, operation for operation
        pixel = ((coords + 1) / 2) * (size - 1)
    else:
        pixel = ((coords + 1) * size - 1) / 2
    low = torch.floor(pixel)
    high_weight = pixel - low
    # one spare column each side: a tap outside the table lands there and is cut off
    weights = coords.new_zeros(*coords.shape, size + 2)
    column = low.long() + 1  # tap `low` in column low + 1
    for tap, weight in ((column, 1 - high_weight), (column + 1, high_weight)):
        weights.scatter_add_(-1, tap.clamp(0, size + 1)[..., None], weight[..., None])
    return weights[..., 1:size + 1]


def jittered_position_embeddings(table: torch.Tensor, rows: int, cols: int, batch_size: int,
                                 input_dims: tuple[int, int], align_corners: bool) -> torch.Tensor:
    """`table [1, rows * cols, hidden]` sampled at a random window per image, as RADIOViTModel's training CPE
    does -> `[batch_size, out_rows * out_cols, hidden]` in the table's dtype."""
    device = table.device
    # megatron-core's draws, in its order and shapes (the same random stream)
    min_scale = math.sqrt(0.1)
    scale = torch.rand(batch_size, 1, 1, device=device) * (1 - min_scale) + min_scale
    aspect_min = math.log(3 / 4)
    aspect_max = -aspect_min
    aspect = torch.exp(torch.rand(batch_size, 1, 1, device=device) * (aspect_max - aspect_min) + aspect_min)
    scale_xy = torch.stack([scale * aspect, scale * (1 / aspect)], dim=-1).clamp_(0, 1)  # [b, 1, 1, 2]
    pos_xy = torch.rand(batch_size, 1, 1, 2, device=device) * (1 - scale_xy)
    out_rows, out_cols = input_dims
    lin_x = torch.linspace(0, 1, steps=out_cols, device=device)
    lin_y = torch.linspace(0, 1, steps=out_rows, device=device)
    # grid = lin * scale + pos, then * 2 - 1: the x coordinate depends on the column only, y on the row only
    grid_x = (lin_x[None] * scale_xy[:, 0, 0, :1] + pos_xy[:, 0, 0, :1]).mul_(2).sub_(1)  # [b, out_cols]
    grid_y = (lin_y[None] * scale_xy[:, 0, 0, 1:] + pos_xy[:, 0, 0, 1:]).mul_(2).sub_(1)  # [b, out_rows]
    wx = _tap_weights(grid_x, cols, align_corners)  # [b, out_cols, cols]
    wy = _tap_weights(grid_y, rows, align_corners)  # [b, out_rows, rows]
    hidden = table.shape[-1]
    # across the rows first, one GEMM on the table as it lies ([rows, cols * hidden], no copy):
    # [b * out_rows, cols * hidden]; then across the columns, batched over the output rows
    across_rows = torch.matmul(wy, table.reshape(rows, cols * hidden).float())
    sampled = torch.matmul(wx[:, None], across_rows.reshape(batch_size, out_rows, cols, hidden))
    return sampled.reshape(batch_size, out_rows * out_cols, hidden).to(table.dtype)
