"""The routed experts' weight gradients added into DDP's fp32 `main_grad`s on the GPU: either computed and added
by one grouped GEMM (`grouped_wgrad`), or added from the bf16 gradients a grouped GEMM produced (`add_stacked`).

torch's grouped GEMM writes each expert's weight gradient in bf16; adding that into the fp32 `main_grad` is a
mixed-dtype add that PyTorch runs element by element, not vectorized (27 ms an iteration of the Nemotron slice, for
a kernel that reads and writes 10 bytes per weight). `add_stacked` is that add as one vectorized Triton kernel for
all experts (the default). `grouped_wgrad` goes further: dW_e += dY_e^T X_e for each expert e's rows, the group
boundaries read on the device (no host synchronization), accumulated in fp32 and added into `main_grad` in the
GEMM's epilogue: no bf16 gradient is written or read again.

Both need the experts' `main_grad`s to be views of one buffer (DDP's gradient buffer): they address each
expert's by its offset in that buffer. Elsewhere (no Triton, tensors on the CPU, separate buffers) the torch
expressions run. The grouped GEMM is used only where `MIMO_GROUPED_WGRAD=fused`: on an H100 at the Nemotron
slice's shapes it is no faster than torch's grouped GEMM followed by `add_stacked` (scripts/gpu/check_grouped_wgrad.py,
docs/benchmarks.md (g)).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the torch expressions
    triton = None

# (BLOCK_M, BLOCK_N, BLOCK_T, warps, stages) of the grouped GEMM: the fastest of the three that
# scripts/gpu/check_grouped_wgrad.py times, at the Nemotron slice's shapes on an H100 (docs/benchmarks.md (g))
GEMM_CONFIG = (128, 256, 64, 8, 3)
_offsets: dict[tuple, tuple[torch.Tensor, bool]] = {}


def fused_wgrad_enabled() -> bool:
    return triton is not None and os.environ.get("MIMO_GROUPED_WGRAD") == "fused"


def _buffer_offsets(main_grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """(the buffer the `main_grad`s are views of, each one's element offset in it on the buffer's device, whether
    every offset is a multiple of 16: the kernels then move 16 bytes at a time), or None where they are not fp32
    contiguous views of one buffer. The offsets are cached (DDP's buffers live as long as the model), not the
    buffer."""
    base = main_grads[0]._base if main_grads[0]._base is not None else main_grads[0]
    key = (base.data_ptr(), *(g.data_ptr() for g in main_grads))
    if key not in _offsets:
        if not all(g.dtype == torch.float32 and g.is_contiguous() and base.dtype == torch.float32
                   and (g._base if g._base is not None else g) is base for g in main_grads):
            return None
        offsets = [(g.data_ptr() - base.data_ptr()) // 4 for g in main_grads]
        _offsets[key] = (torch.tensor(offsets, dtype=torch.int64).to(base.device),
                         all(o % 16 == 0 for o in offsets))
    return (base, *_offsets[key])


def add_stacked(main_grads: list[torch.Tensor], grad: torch.Tensor) -> None:
    """main_grads[e] += grad[e] for a stacked gradient [E, ...] (any float dtype)."""
    # a strided gradient (a transposed GEMM output) keeps PyTorch's add: a copy first would cost what is saved
    located = _buffer_offsets(main_grads) if triton is not None and grad.is_cuda and grad.is_contiguous() else None
    if located is None:
        torch._foreach_add_(main_grads, list(grad.unbind(0)))
        return
    base, offsets, aligned = located
    numel = grad[0].numel()
    block = 4096
    _add_stacked[(triton.cdiv(numel, block), len(main_grads))](grad, base, offsets, numel, ALIGNED=aligned,
                                                                 BLOCK=block)


def grouped_wgrad(main_grads: list[torch.Tensor], grad_out: torch.Tensor, inputs: torch.Tensor,
                  ends: torch.Tensor) -> None:
    """main_grads[e] ([N, K], fp32) += grad_out[rows_e]^T @ inputs[rows_e] for grad_out [T, N] and inputs [T, K],
    rows_e the rows from ends[e-1] (0 for the first) to ends[e] (int32, cumulative, on the device)."""
    located = _buffer_offsets(main_grads) if grad_out.is_cuda else None
    if located is None:
        grad = torch.nn.functional.grouped_mm(grad_out.t(), inputs, offs=ends)
        add_stacked(main_grads, grad)
        return
    launch_grouped_wgrad(*located, grad_out.contiguous(), inputs.contiguous(), ends)


def launch_grouped_wgrad(base: torch.Tensor, offsets: torch.Tensor, aligned: bool, grad_out: torch.Tensor,
                         inputs: torch.Tensor, ends: torch.Tensor, config: tuple = GEMM_CONFIG) -> None:
    """The kernel itself (tests run it under Triton's interpreter): `base` the buffer, `offsets` [E] each expert's
    [N, K] block in it, `aligned` whether they are all multiples of 16."""
    block_m, block_n, block_t, warps, stages = config
    n, k = grad_out.shape[1], inputs.shape[1]
    grid = (triton.cdiv(n, block_m) * triton.cdiv(k, block_n), offsets.numel())
    _grouped_wgrad[grid](grad_out, inputs, ends, base, offsets, n, k, ALIGNED=aligned, BLOCK_M=block_m,
                         BLOCK_N=block_n, BLOCK_T=block_t, num_warps=warps, num_stages=stages)


if triton is not None:
    @triton.jit
    def _expert_offset(offsets_ptr, expert, ALIGNED: tl.constexpr):
        offset = tl.load(offsets_ptr + expert)
        if ALIGNED:
            offset = tl.multiple_of(offset, 16)
        return offset

    @triton.jit
    def _add_stacked(grad_ptr, base_ptr, offsets_ptr, numel, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        expert = tl.program_id(1)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < numel
        g = tl.load(grad_ptr + expert.to(tl.int64) * numel + i, mask=mask, other=0.0).to(tl.float32)
        dst = base_ptr + _expert_offset(offsets_ptr, expert, ALIGNED) + i
        tl.store(dst, tl.load(dst, mask=mask, other=0.0) + g, mask=mask)

    @triton.jit
    def _grouped_wgrad(dy_ptr, x_ptr, ends_ptr, base_ptr, offsets_ptr, N, K, ALIGNED: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
        expert = tl.program_id(1)
        tile = tl.program_id(0)
        tiles_n = tl.cdiv(K, BLOCK_N)
        rm = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
        end = tl.load(ends_ptr + expert).to(tl.int64)
        if end > start:  # an expert without tokens keeps its gradient
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            rt = tl.arange(0, BLOCK_T)
            for t in range(start, end, BLOCK_T):
                rows = t + rt
                in_rows = rows[:, None] < end
                a = tl.load(dy_ptr + rows[:, None] * N + rm[None, :], mask=in_rows & (rm[None, :] < N), other=0.0)
                b = tl.load(x_ptr + rows[:, None] * K + rn[None, :], mask=in_rows & (rn[None, :] < K), other=0.0)
                acc += tl.dot(tl.trans(a), b)
            dst = base_ptr + _expert_offset(offsets_ptr, expert, ALIGNED) + rm[:, None].to(tl.int64) * K + rn[None, :]
            mask = (rm[:, None] < N) & (rn[None, :] < K)
            tl.store(dst, tl.load(dst, mask=mask, other=0.0) + acc, mask=mask)
