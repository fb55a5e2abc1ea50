"""Weight gradients added into DDP's fp32 `main_grad` where they are computed, instead of produced as a separate
tensor that DDP's hook then adds: one fewer write and two fewer reads of each weight's gradient per micro-batch
(the Nemotron slice's output layer, embedding and routed experts spent about 50 ms of an H100's 1.2 s iteration
in those adds, docs/benchmarks.md (g)).

* transformer-engine's layers do it inside their weight-gradient GEMM (`fuse_wgrad_accumulation`), switched on
  here after DDP gave the weights their `main_grad`: megatron-core's config flag would also ask its own linear
  layers for Apex's kernel.
* megatron-core's own ColumnParallelLinear / RowParallelLinear at TP 1 (the LLM's output layer, the encoders'
  patch embedding and projection): their `_forward_impl` (megatron-core's hook for the linear function) becomes
  `_MainGradLinear`, whose backward accumulates the weight gradient into fp32 with transformer-engine's GEMM, or,
  without transformer-engine, computes it as megatron-core does and adds it.
* megatron-core's VocabParallelEmbedding at TP 1: `_MainGradEmbedding` adds each token's gradient row into
  `main_grad` instead of building a dense [vocab, hidden] gradient that is then added whole.

Every trained parameter with a `main_grad` is marked for the layers of `mimo.plugins.kit.main_grad` (a grouped
GEMM's experts add theirs in one call); each backward marks its weight `grad_added_to_main_grad` and hands
autograd a placeholder gradient that DDP's hook skips, or none at all where that hook is optional (no overlapped
reduction).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mimo.plugins.kit.main_grad import adds_into_main_grad, gradient_for_autograd


def fuse_weight_gradient_accumulation(model, *, transformer_engine: bool = True, hooks_needed: bool = True) -> int:
    """Every layer of `model` that can add its weight gradient into `main_grad` does so from now on;
    `transformer_engine` False leaves transformer-engine's layers as they are; `hooks_needed`: DDP's gradient
    hooks do more than add (overlapped reduction). Call after DDP wrapped the modules. Returns the layers
    changed."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
    )

    for param in model.parameters():
        if param.requires_grad and hasattr(param, "main_grad"):
            param.add_into_main_grad = True
            param.main_grad_hook_optional = not hooks_needed
    te_base = _te_module_base() if transformer_engine else None
    changed = 0
    for module in model.modules():
        if te_base is not None and isinstance(module, te_base) and hasattr(module, "fuse_wgrad_accumulation"):
            trained = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if trained and all(hasattr(p, "main_grad") for p in trained):
                module.fuse_wgrad_accumulation = True
                changed += 1
        elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and _single_rank(module):
            module._forward_impl = _linear_impl(module._forward_impl)
            changed += 1
        elif isinstance(module, VocabParallelEmbedding) and _embedding_fusable(module):
            module.forward = _embedding_forward(module)
            changed += 1
    return changed


def _te_module_base():
    try:
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    except ImportError:
        return None
    return TransformerEngineBaseModule


def _single_rank(module) -> bool:
    group = getattr(module, "tp_group", None)
    return (group is None or group.size() == 1) and getattr(module, "gtp_remat_size", 1) <= 1


def _embedding_fusable(module) -> bool:
    weight = module.weight
    # deterministic mode indexes the weight (a deterministic backward); index_add_ on a GPU is not
    return (_single_rank(module) and not module.reduce_scatter_embeddings and not module.deterministic_mode
            and weight is not None and weight.requires_grad and adds_into_main_grad([weight]))


def _linear_impl(megatron_impl):
    """megatron-core's `_forward_impl` where this layer's call can add into main_grad, else megatron-core's own."""

    def forward_impl(input, weight, bias=None, *, allreduce_dgrad=False, sequence_parallel=False,
                     grad_output_buffer=None, **others):
        if (not weight.requires_grad or not adds_into_main_grad([weight]) or allreduce_dgrad or sequence_parallel
                or grad_output_buffer is not None or others.get("gtp_remat_size", 1) > 1):
            return megatron_impl(input=input, weight=weight, bias=bias, allreduce_dgrad=allreduce_dgrad,
                                 sequence_parallel=sequence_parallel, grad_output_buffer=grad_output_buffer,
                                 **others)
        return _MainGradLinear.apply(input, weight, bias)

    return forward_impl


def _embedding_forward(module):
    def forward(input_):
        return _MainGradEmbedding.apply(input_, module.weight)

    return forward


def add_weight_gradient(weight: torch.Tensor, inputs: torch.Tensor, grads: torch.Tensor) -> None:
    """weight.main_grad += grads^T @ inputs ([tokens, out] and [tokens, in])."""
    main_grad = weight.main_grad
    gemm = _te_gemm() if grads.is_cuda and grads.dtype in (torch.bfloat16, torch.float16) else None
    if gemm is not None and main_grad.dtype == torch.float32 and inputs.dtype == grads.dtype:
        # the GEMM adds its fp32 result into main_grad: no bf16 gradient in between
        gemm(inputs.contiguous(), grads.contiguous(), out_dtype=torch.float32, layout="NT", out=main_grad,
             accumulate=True, grad=True)
    else:
        main_grad.add_(grads.t().matmul(inputs))  # megatron-core's own computation, then the add


def _te_gemm():
    try:
        from transformer_engine.pytorch.cpp_extensions import general_gemm
    except ImportError:
        return None
    return general_gemm


class _MainGradLinear(torch.autograd.Function):
    """y = x W^T (+ b), as megatron-core's linear at TP 1; backward adds dW into W.main_grad."""

    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(input, weight)
        ctx.weight, ctx.with_bias = weight, bias is not None
        output = torch.matmul(input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grads = grad_output.reshape(-1, grad_output.shape[-1])
        add_weight_gradient(ctx.weight, input.reshape(-1, input.shape[-1]), grads)
        grad_bias = grads.sum(dim=0) if ctx.with_bias else None
        return grad_input, gradient_for_autograd(ctx.weight), grad_bias


class _MainGradEmbedding(torch.autograd.Function):
    """F.embedding(ids, W); backward adds each row's gradient into W.main_grad."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        main_grad = weight.main_grad
        main_grad.index_add_(0, ids.reshape(-1), grad_output.reshape(-1, grad_output.shape[-1]).to(main_grad.dtype))
        return None, gradient_for_autograd(weight)
