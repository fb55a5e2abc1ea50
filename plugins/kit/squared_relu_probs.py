"""The routed experts' activation for squared-ReLU MoE layers (Nemotron's): `relu(x)^2 * p`, each token's routing
probability `p` applied after the activation, as one Triton kernel forward and one backward.

Eagerly that is four kernels forward (relu, pow, the product with the fp32 probabilities into fp32, the cast
back) and about as many again backward, each a full pass over the [tokens x top-k, ffn] activations: about 60
bytes moved per element where the fused kernels move 10. The fused kernels compute in fp32 and round once (the
eager path rounds relu(x)^2 to bf16 before the product); values agree to bf16's precision
(scripts/gpu/check_squared_relu_probs.py checks them on a GPU).

Used by `mimo.plugins.kit.grouped_mm_moe` where the activation is megatron-core's `squared_relu` and the tensors
are on a GPU with Triton; elsewhere the eager expression runs.
"""

from __future__ import annotations

import torch
from megatron.core.activations import squared_relu

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (a CPU-only install): the eager expression
    triton = None


def squared_relu_probs(up: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """[rows, ffn] activations of `up`'s dtype: relu(up)^2 times `probs` [rows] (any float dtype)."""
    if triton is None or not up.is_cuda or up.dim() != 2 or up.shape[0] == 0:
        return eager(up, probs)
    return _SquaredReluProbs.apply(up, probs)


def eager(up: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """megatron-core's expression: the activation in up's dtype, the product in the probabilities' precision."""
    return (squared_relu(up) * probs.unsqueeze(-1)).to(up.dtype)


class _SquaredReluProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, up, probs):
        up, probs = up.contiguous(), probs.contiguous()
        out = torch.empty_like(up)
        rows, cols = up.shape
        _forward[(rows,)](up, probs, out, cols, BLOCK=triton.next_power_of_2(cols))
        ctx.save_for_backward(up, probs)
        return out

    @staticmethod
    def backward(ctx, grad):
        up, probs = ctx.saved_tensors
        grad = grad.contiguous()
        rows, cols = up.shape
        grad_up = torch.empty_like(up)
        grad_probs = torch.empty(rows, dtype=torch.float32, device=up.device)
        _backward[(rows,)](up, probs, grad, grad_up, grad_probs, cols, BLOCK=triton.next_power_of_2(cols))
        return grad_up, grad_probs.to(probs.dtype) if ctx.needs_input_grad[1] else None


if triton is not None:
    @triton.jit
    def _forward(up_ptr, probs_ptr, out_ptr, cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.arange(0, BLOCK)
        mask = offsets < cols
        x = tl.load(up_ptr + row * cols + offsets, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(probs_ptr + row).to(tl.float32)
        r = tl.maximum(x, 0.0)
        tl.store(out_ptr + row * cols + offsets, (r * r * p).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward(up_ptr, probs_ptr, grad_ptr, grad_up_ptr, grad_probs_ptr, cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.arange(0, BLOCK)
        mask = offsets < cols
        x = tl.load(up_ptr + row * cols + offsets, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(grad_ptr + row * cols + offsets, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(probs_ptr + row).to(tl.float32)
        r = tl.maximum(x, 0.0)
        tl.store(grad_up_ptr + row * cols + offsets, (2.0 * r * g * p).to(grad_up_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_probs_ptr + row, tl.sum(g * r * r, axis=0))
