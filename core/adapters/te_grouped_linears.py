"""Adapters on transformer-engine's grouped linears: the fallback forward of mimo's `GroupedMMExperts` (megatron-core
TEGroupedMLP's own), which runs where the experts cannot run as mimo's grouped GEMMs, above all under FP8/FP4.

That forward calls `linear_fc1(x, m_splits)` and `linear_fc2(h, m_splits)`, `m_splits` the host list of rows per
local expert, `h` the activation times the routing probabilities. For the call's duration each of the two gets a
forward hook that adds the same adapter term the grouped-GEMM path adds (grouped_experts.term: `f(x, offsets)`),
over offsets built from the `m_splits` the linear received: under FP8 megatron-core pads each expert's rows to a
multiple of 16 with zeros first, and a zero row gets a zero term (no bias in an adapter). fc2's term is added to
fc2's output, which megatron-core's selective recompute registers its recompute on: the recompute comes before
either term's backward reads the activation.

The adapters run in the run's precision (bf16), outside transformer-engine's FP8 autocast (which only quantizes
transformer-engine's modules): they are small, FP8 would cost accuracy for no speed. The adapter parameters are the
grouped-GEMM path's own objects, so the checkpoint, merge and memory plan do not depend on which path ran.
"""

from __future__ import annotations

import contextlib

import torch

FC = ("linear_fc1", "linear_fc2")


def offsets_of(m_splits, device: torch.device) -> torch.Tensor:
    """The cumulative row counts of `m_splits` (a host list, or a tensor) as an int32 tensor on `device`: the
    `offs` of torch's grouped GEMM."""
    counts = torch.as_tensor(m_splits, dtype=torch.int32)
    if device.type == "cuda" and counts.device.type == "cpu":  # pinned: a pageable copy would wait for the GPU
        counts = counts.pin_memory()
    return counts.to(device, non_blocking=True).cumsum(0, dtype=torch.int32)


def _adding(term):
    """A forward hook on a grouped linear that returns (out, bias): `out` plus `term(x, offsets)`."""

    def hook(module, args, result):
        x, m_splits = args[0], args[1]
        out, bias = result if isinstance(result, tuple) else (result, None)
        out = out + term(x, offsets_of(m_splits, x.device)).to(out.dtype)
        return (out, bias) if isinstance(result, tuple) else out

    return hook


@contextlib.contextmanager
def terms_on_grouped_linears(experts: torch.nn.Module, terms: tuple):
    """Within the block, `experts.linear_fc1` / `linear_fc2` add `terms` (fc1's, fc2's; None: nothing) to their
    outputs."""
    handles = [getattr(experts, fc).register_forward_hook(_adding(term))
               for fc, term in zip(FC, terms) if term is not None]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
