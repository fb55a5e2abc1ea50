"""A micro-batch from the host to the device, as the step, the encoder pass and generation move it."""

from __future__ import annotations

import torch

# Encoder arguments that describe the batch rather than feed a kernel: they stay on the host, where the encoder
# reads them without waiting for the GPU (mimo.plugins.data's dynamic-resolution images; an image grid's `grid_thw`,
# transformers' name, which Qwen's vision tower reads).
HOST_ARGUMENTS = ("imgs_sizes", "grid_thw")


def to_device(value, device: torch.device, float_dtype: torch.dtype):
    """Move a (nested) batch to the device; floating-point model inputs take the model's dtype."""
    if isinstance(value, torch.Tensor):
        cast = float_dtype if value.is_floating_point() else value.dtype
        # moved, then cast on the device: a copy that also casts converts on the host into pageable memory, and a
        # copy from pageable memory waits for the GPU; from the read-ahead's pinned memory this one does not
        return value.to(device=device, non_blocking=True).to(cast)
    if isinstance(value, dict):
        return {k: v if k in HOST_ARGUMENTS else to_device(v, device, float_dtype) for k, v in value.items()}
    return value
