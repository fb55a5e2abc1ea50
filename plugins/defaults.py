"""Hook implementations mimo ships for every provider; a provider's own implementation takes precedence."""

from __future__ import annotations

import torch

from .hookspecs import hookimpl


@hookimpl(trylast=True)
def loss(output_tensor, loss_mask):
    """Sum of the language model's per-token losses over the tokens that count, and their number."""
    mask = loss_mask.float()
    return (output_tensor.float() * mask).sum(), mask.sum().to(torch.int)


@hookimpl(trylast=True)
def frozen_parameters():
    return []
