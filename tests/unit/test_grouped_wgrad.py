"""The experts' weight gradients added into `main_grad` (mimo.plugins.kit.grouped_wgrad): the Triton kernels
(run by Triton's interpreter on the CPU, in fp32: it has no bf16) address each expert's `main_grad` by its offset in
one buffer, in any order, and leave an expert without tokens alone; the grouped experts give autograd's own
gradients through the main_grad route. bf16 on a GPU: scripts/gpu/check_grouped_wgrad.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

INTERPRETED = textwrap.dedent("""
    import torch, triton
    from mimo.plugins.kit import grouped_wgrad as gw

    torch.manual_seed(0)
    experts, n, k = 3, 40, 24
    counts = torch.tensor([5, 0, 70])  # an expert without tokens; more rows than one block
    ends = counts.cumsum(0).to(torch.int32)
    dy, x = torch.randn(int(ends[-1]), n), torch.randn(int(ends[-1]), k)
    buffer = torch.randn(experts * n * k + 64)
    # DDP lays parameters out in reverse: the last expert first; 64 elements of something else before them
    grads = [buffer[64 + (experts - 1 - e) * n * k:64 + (experts - e) * n * k].view(n, k) for e in range(experts)]
    before = buffer.clone()
    expected, start = [], 0
    for g, c in zip(grads, counts.tolist()):
        expected.append(g + dy[start:start + c].t() @ x[start:start + c])
        start += c
    base, offsets, aligned = gw._buffer_offsets(grads)
    assert base is buffer and offsets.tolist() == [64 + 2 * n * k, 64 + n * k, 64] and aligned
    gw.launch_grouped_wgrad(base, offsets, aligned, dy, x, ends, config=(16, 16, 16, 4, 1))
    worst = max((g - e).abs().max().item() for g, e in zip(grads, expected))
    assert worst < 1e-4, worst
    assert torch.equal(buffer[:64], before[:64])
    assert torch.equal(grads[1], expected[1])  # no tokens: unchanged

    stacked = torch.randn(experts, n, k)
    before = [g.clone() for g in grads]
    gw._add_stacked[(triton.cdiv(n * k, 256), experts)](stacked, base, offsets, n * k, ALIGNED=True, BLOCK=256)
    assert all(torch.equal(g, b + s) for g, b, s in zip(grads, before, stacked))
    print("ok")
""")


def test_kernels_address_each_expert_in_the_buffer():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_separate_buffers_are_not_addressed():
    from mimo.plugins.kit.grouped_wgrad import _buffer_offsets

    assert _buffer_offsets([torch.zeros(2, 3), torch.zeros(2, 3)]) is None
    assert _buffer_offsets([torch.zeros(12, dtype=torch.bfloat16)[:6].view(2, 3)]) is None


def _weights(experts: int, out: int, inp: int) -> list[torch.nn.Parameter]:
    weights = []
    for _ in range(experts):
        w = torch.nn.Parameter(torch.randn(out, inp) * 0.1)
        w.main_grad = torch.zeros(out, inp)
        w.add_into_main_grad, w.main_grad_hook_optional = True, True
        weights.append(w)
    return weights


def test_grouped_experts_put_autograds_gradients_into_main_grad():
    from megatron.core.activations import squared_relu

    from mimo.plugins.kit.grouped_mm_moe import grouped_experts

    torch.manual_seed(0)
    experts, hidden_size, ffn = 4, 16, 8
    counts = torch.tensor([3, 0, 6, 2])
    hidden = torch.randn(int(counts.sum()), hidden_size)
    probs = torch.rand(int(counts.sum()))
    fc1, fc2 = _weights(experts, ffn, hidden_size), _weights(experts, hidden_size, ffn)

    reference_hidden = hidden.clone().requires_grad_()
    out = grouped_experts(reference_hidden, counts, probs, torch.stack(fc1), torch.stack(fc2), squared_relu)
    out.square().sum().backward()

    routed_hidden = hidden.clone().requires_grad_()
    for micro_batch in range(2):  # accumulates
        out_routed = grouped_experts(routed_hidden, counts, probs, fc1, fc2, squared_relu)
        out_routed.square().sum().backward()
    torch.testing.assert_close(out_routed, out)
    torch.testing.assert_close(routed_hidden.grad, 2 * reference_hidden.grad)
    for w in fc1 + fc2:
        assert w.grad is not None and w.grad_added_to_main_grad is True
        torch.testing.assert_close(w.main_grad, 2 * w.grad, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(fc1[1].main_grad) == 0  # the expert without tokens


def test_kernels_compile_for_hopper():
    """Both kernels build for sm90 (no GPU needed): the GEMM on wgmma, the aligned adds 16 bytes at a time."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mimo.plugins.kit import grouped_wgrad as gw

    def ptx(fn, signature: dict, constexprs: dict, **options) -> str:
        aligned = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind != "constexpr"}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

    pointers = {"base_ptr": "*fp32", "offsets_ptr": "*i64"}
    add = ptx(gw._add_stacked, {"grad_ptr": "*bf16", **pointers, "numel": "i32", "ALIGNED": "constexpr",
                                "BLOCK": "constexpr"}, {"ALIGNED": True, "BLOCK": 4096})
    assert "st.global.v4.b32" in add
    block_m, block_n, block_t, warps, stages = gw.GEMM_CONFIG
    gemm = ptx(gw._grouped_wgrad, {"dy_ptr": "*bf16", "x_ptr": "*bf16", "ends_ptr": "*i32", **pointers, "N": "i32",
                                   "K": "i32", "ALIGNED": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                                   "BLOCK_T": "constexpr"},
               {"ALIGNED": True, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_T": block_t},
               num_warps=warps, num_stages=stages)
    assert "wgmma.mma_async" in gemm and "st.global.v4.b32" in gemm
