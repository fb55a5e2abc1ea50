"""Layers that add their weight gradients into megatron-core DDP's fp32 `main_grad` themselves, and what they hand
autograd for those weights.

DDP gives every trained parameter a `main_grad` (a view into its gradient buffer) and a hook on the parameter's
gradient accumulator that adds `param.grad` into it, skipping a weight marked `grad_added_to_main_grad`. mimo's
loop (mimo.core.parallel.wgrad_fusion, unless --no-grad-accum-fusion) marks each such parameter:

* `add_into_main_grad`: a layer may add the weight's gradient into `main_grad` itself (in the GEMM, or in one
  multi-tensor kernel for many weights), instead of producing it for the hook to add;
* `main_grad_hook_optional`: nothing but that add needs the hook (no overlapped reduction, which counts each
  parameter's hook to start a bucket's reduction), so such a layer may hand autograd no gradient at all: no
  accumulator, no hook, no Python for that weight.
"""

from __future__ import annotations

import torch

from .expert_storage import as_stack
from .grouped_wgrad import add_stacked

_placeholders: dict[tuple, torch.Tensor] = {}


def adds_into_main_grad(weights) -> bool:
    """Whether a layer may add these weights' gradients into their `main_grad` itself."""
    return all(getattr(w, "add_into_main_grad", False) and hasattr(w, "main_grad") for w in weights)


def gradient_for_autograd(weight: torch.Tensor) -> torch.Tensor | None:
    """What a layer that added `weight`'s gradient into `main_grad` returns to autograd for it: nothing where DDP's
    hook is optional, else a placeholder the hook skips (the weight is marked added). One buffer per shape, handed
    out as a new tensor object so that autograd takes it over without a copy."""
    weight.grad_added_to_main_grad = True
    if getattr(weight, "main_grad_hook_optional", False):
        return None
    key = (tuple(weight.shape), weight.dtype, weight.device)
    if key not in _placeholders:
        _placeholders[key] = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    return _placeholders[key].detach()


class StackedWeights(torch.autograd.Function):
    """torch.stack(weights) (their own storage where they lie back to back in one: no copy, expert_storage.py).
    With `into_main_grad` backward adds the stacked gradient into the weights' `main_grad`s in one call instead of
    one gradient, accumulator, hook and add per weight (a grouped GEMM's experts; use where
    `adds_into_main_grad(weights)`); without, it hands each weight its row, as torch.stack's backward does."""

    @staticmethod
    def forward(ctx, into_main_grad, *weights):
        ctx.weights, ctx.into_main_grad = weights, into_main_grad
        return as_stack(weights)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.into_main_grad:
            return None, *grad.unbind(0)
        add_stacked([w.main_grad for w in ctx.weights], grad)
        return None, *(gradient_for_autograd(w) for w in ctx.weights)


def stacked(weights) -> torch.Tensor:
    """The weights stacked for a grouped GEMM; their gradients go straight into `main_grad` where allowed."""
    return StackedWeights.apply(adds_into_main_grad(weights), *weights)
