"""LocalMambaMixer (providers/nemotron/mamba_mixer.py): the chunked SSD scan against a step-by-step recurrence,
the whole mixer against a from-scratch reference, and its parameters against megatron-core's MambaMixer."""

from __future__ import annotations


import pytest

from helpers import world_of_one
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from mimo.core.run.launch import seed_everything
from mimo.providers.nemotron.mamba_mixer import LocalMambaMixer, MambaMixerSubmodules, ssd_scan

LOCAL_SPEC = MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)


def reference_ssm_scan(x, dt, A, B, C, D):
    """The Mamba-2 recurrence one step at a time. x [b,l,h,p], dt [b,l,h], A [h], B/C [b,l,g,n], D [h] or [h*p]."""
    b, l, h, p = x.shape
    r = h // B.shape[2]
    B, C = B.repeat_interleave(r, dim=2), C.repeat_interleave(r, dim=2)  # head i reads group i // r
    D = D.view(h, 1) if D.numel() == h else D.view(h, p)
    state = x.new_zeros(b, h, p, B.shape[-1])
    ys = []
    for t in range(l):
        dt_t = dt[:, t, :, None, None]
        state = torch.exp(dt_t * A[:, None, None]) * state + dt_t * x[:, t, :, :, None] * B[:, t, :, None, :]
        ys.append((state * C[:, t, :, None, :]).sum(-1) + D * x[:, t])
    return torch.stack(ys, dim=1)


# ----------------------------------------------------------------------------------------------- the scan


def _scan_inputs(l, dtype=torch.float64, b=2, h=6, g=3, p=4, n=5, D_per_channel=False, decay_scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, h, p, generator=gen, dtype=dtype)
    dt = F.softplus(torch.randn(b, l, h, generator=gen, dtype=dtype))
    A = -torch.exp(torch.empty(h, dtype=dtype).uniform_(-2.0, 1.5, generator=gen)) * decay_scale
    B = torch.randn(b, l, g, n, generator=gen, dtype=dtype)
    C = torch.randn(b, l, g, n, generator=gen, dtype=dtype)
    D = torch.randn(h * p if D_per_channel else h, generator=gen, dtype=dtype)
    return [t.requires_grad_() for t in (x, dt, A, B, C, D)]


@pytest.mark.parametrize("l", [1, 5, 8, 16, 23, 50])
@pytest.mark.parametrize("D_per_channel", [False, True])
def test_chunked_scan_matches_recurrence(l, D_per_channel):
    inputs = _scan_inputs(l, D_per_channel=D_per_channel)
    y = ssd_scan(*inputs, chunk_size=8)
    y_ref = reference_ssm_scan(*inputs)
    assert y.shape == y_ref.shape and y.dtype == torch.float64
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)

    grad_out = torch.randn_like(y)
    grads = torch.autograd.grad(y, inputs, grad_out)
    grads_ref = torch.autograd.grad(y_ref, inputs, grad_out)
    for name, got, want in zip("x dt A B C D".split(), grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=lambda m: f"d/d{name}: {m}")


def test_chunked_scan_is_stable_under_strong_decay():
    """Decays of e^-1000 per step, long chunks, fp32: no inf/nan and still the recurrence's answer."""
    inputs = _scan_inputs(150, dtype=torch.float32, decay_scale=300.0)
    y = ssd_scan(*inputs, chunk_size=64)
    grads = torch.autograd.grad(y.square().sum(), inputs)
    assert torch.isfinite(y).all() and all(torch.isfinite(g).all() for g in grads)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    y_ref = reference_ssm_scan(*ref_inputs)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)
    for got, want in zip(grads, torch.autograd.grad(y_ref.square().sum(), ref_inputs)):
        torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-3)


def test_chunk_size_does_not_change_the_result():
    inputs = _scan_inputs(37)
    ys = [ssd_scan(*inputs, chunk_size=cs) for cs in (1, 4, 16, 64)]
    for y in ys[1:]:
        torch.testing.assert_close(y, ys[0], rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------ megatron fixtures


@pytest.fixture(scope="module")
def pg_collection():
    """A world of one (gloo) and explicit process groups: no megatron parallel_state initialization."""
    with world_of_one():
        group = dist.new_group([0])
        yield ProcessGroupCollection(tp=group, cp=group, pp=group, dp=group, dp_cp=group, tp_cp=group, ep=group,
                                     expt_tp=group, expt_dp=group, tp_ep=group, mp=group)


def make_config(hidden=16, heads=4, head_dim=8, groups=2, state=6, dtype=torch.float32, **kwargs):
    return TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=2, mamba_num_heads=heads,
                             mamba_head_dim=head_dim, mamba_num_groups=groups, mamba_state_dim=state,
                             use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                             **kwargs)


def make_mixer(pg_collection, config=None, seed=1234, **kwargs):
    seed_everything(seed, tp_rank=0, ep_rank=0, etp_rank=0)
    return LocalMambaMixer(config or make_config(), LOCAL_SPEC, d_model=(config or make_config()).hidden_size,
                           pg_collection=pg_collection, **kwargs)


# ------------------------------------------------------------------------------------------ the mixer


def reference_mixer(params, h, *, heads, head_dim, groups, state, d_conv=4, eps=1e-5, rmsnorm=True,
                    gate_after_norm=False, swap_B_C=False, flip_conv_taps=False):
    """MambaMixer's math written out from its parameters; h [l, b, d_model] -> [l, b, d_model]."""
    l, b, _ = h.shape
    d_inner, gn = heads * head_dim, groups * state
    z, x, B, C, dt = (h @ params["in_proj.weight"].T).split([d_inner, d_inner, gn, gn, heads], dim=-1)
    xBC = torch.cat([x, B, C], dim=-1)
    w = params["conv1d_weight"][:, 0, :]  # tap k multiplies the input d_conv-1-k steps back
    if flip_conv_taps:
        w = w.flip(-1)
    conv = params["conv1d_bias"] + sum(w[:, k] * F.pad(xBC, (0, 0, 0, 0, d_conv - 1 - k, 0))[:l]
                                       for k in range(d_conv))
    x, B, C = F.silu(conv).split([d_inner, gn, gn], dim=-1)
    if swap_B_C:
        B, C = C, B
    dt = F.softplus(dt + params["dt_bias"])
    y = reference_ssm_scan(x.view(l, b, heads, head_dim).transpose(0, 1), dt.transpose(0, 1),
                           -torch.exp(params["A_log"]), B.view(l, b, groups, state).transpose(0, 1),
                           C.view(l, b, groups, state).transpose(0, 1), params["D"])
    y = y.reshape(b, l, d_inner).transpose(0, 1)

    def norm(v):
        v = v.view(l, b, groups, -1)
        return (v / torch.sqrt(v.square().mean(-1, keepdim=True) + eps)).view(l, b, d_inner) * params["norm.weight"]

    if not rmsnorm:
        y = y * F.silu(z)
    elif gate_after_norm:
        y = norm(y) * F.silu(z)
    else:
        y = norm(y * F.silu(z))
    return y @ params["out_proj.weight"].T


@pytest.mark.parametrize("D_has_hdim,rmsnorm", [(False, True), (True, False)])
def test_mixer_matches_reference(pg_collection, D_has_hdim, rmsnorm):
    dims = dict(heads=4, head_dim=8, groups=2, state=6)
    mixer = make_mixer(pg_collection, chunk_size=4, D_has_hdim=D_has_hdim, rmsnorm=rmsnorm)
    with torch.no_grad():  # move the parameters off their special initial values
        mixer.D.uniform_(-1, 1)
        mixer.in_proj.weight.mul_(10)  # inputs of order 1, so gates, decays and the norm all matter
        mixer.out_proj.weight.mul_(30)  # outputs of order 1, so the tolerances below are relative ones
        if rmsnorm:
            mixer.norm.weight.uniform_(0.5, 1.5)
    names = [n for n, _ in mixer.named_parameters()]
    params = dict(mixer.named_parameters())
    h = torch.randn(13, 2, 16, requires_grad=True)  # 13 = 3 chunks of 4 and a partial one

    out, out_bias = mixer(h)
    assert out_bias is None and out.shape == h.shape and out.dtype == h.dtype
    h64 = h.detach().double().requires_grad_()
    params64 = {n: p.double() for n, p in params.items()}
    ref = reference_mixer(params64, h64, rmsnorm=rmsnorm, **dims)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)

    # The tolerance above is far tighter than what a plausible mistake would leave behind.
    for wrong in [dict(swap_B_C=True), dict(flip_conv_taps=True)] + [dict(gate_after_norm=True)] * rmsnorm:
        wrong_out = reference_mixer(params64, h64, rmsnorm=rmsnorm, **dims, **wrong)
        assert (wrong_out - ref).abs().max() > 1e-2 * ref.abs().max(), wrong

    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [h, *params.values()], grad_out)
    grads_ref = torch.autograd.grad(ref, [h64, *params.values()], grad_out.double())
    for name, got, want in zip(["input", *names], grads, grads_ref):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-3, atol=1e-5,
                                   msg=lambda m: f"d/d{name}: {m}")


def test_mixer_bf16_follows_fp32(pg_collection):
    mixer32 = make_mixer(pg_collection, chunk_size=8)
    mixer16 = make_mixer(pg_collection, config=make_config(dtype=torch.bfloat16), chunk_size=8)
    mixer16.load_state_dict(mixer32.state_dict())
    h = torch.randn(20, 2, 16)
    out16, _ = mixer16(h.bfloat16())
    out32, _ = mixer32(h)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), out32, rtol=0.05, atol=0.02)
    out16.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mixer16.parameters())


def test_mixer_rejects_what_it_does_not_do(pg_collection):
    mixer = make_mixer(pg_collection)
    h = torch.randn(4, 1, 16)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32))
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.utils import InferenceMode

    with InferenceMode.active(), pytest.raises(NotImplementedError, match="static inference context only"):
        mixer(h, inference_context=StaticInferenceContext(1, 8), packed_seq_params=packed)  # decoding: one sequence
    with pytest.raises(ValueError, match="THD format with batch 1"):
        mixer(torch.randn(4, 2, 16), packed_seq_params=packed)
    with pytest.raises(ValueError, match="THD format with batch 1"):
        mixer(h, packed_seq_params=PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=packed.cu_seqlens_q))


def test_packed_sequences_are_scanned_each_on_its_own(pg_collection):
    """Sequences laid end to end (THD, padded boundaries) give what each gives alone: no state or convolution
    crosses a boundary; tokens past the last sequence are padding."""
    mixer = make_mixer(pg_collection)
    lengths, padded = [5, 1, 7], [6, 1, 9]  # the padded tails of the first and last sequences
    h = torch.randn(sum(padded), 1, 16)
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    cu_padded = torch.tensor([0, 6, 7, 16], dtype=torch.int32)
    packed, _ = mixer(h, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu,
                                                            cu_seqlens_q_padded=cu_padded))
    for start, length in zip(cu_padded[:-1].tolist(), lengths):
        alone, _ = mixer(h[start:start + length])
        torch.testing.assert_close(packed[start:start + length], alone, rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------- parameters as megatron's MambaMixer has them


def mamba_mixer_parameters(d_model, heads, head_dim, groups, state, d_conv=4, tp=1, D_has_hdim=False,
                           rmsnorm=True):
    """Names and shapes of megatron-core 0.19.2 MambaMixer's parameters with a local (ColumnParallelLinear /
    RowParallelLinear, bias=False) spec, in registration order, read off megatron/core/ssm/mamba_mixer.py:
    conv1d_weight [conv_dim, 1, d_conv] and conv1d_bias [conv_dim] with conv_dim = (d_inner + 2*groups*state)/tp;
    dt_bias, A_log [heads/tp]; D [heads/tp] or [d_inner/tp]; then the submodules in_proj.weight
    [(2*d_inner + 2*groups*state + heads)/tp, d_model] (rows z|x|B|C|dt), norm.weight [d_inner/tp] (RMSNormGated),
    out_proj.weight [d_model, d_inner/tp]."""
    d_inner = heads * head_dim
    conv_dim = (d_inner + 2 * groups * state) // tp
    expected = [("conv1d_weight", (conv_dim, 1, d_conv)), ("conv1d_bias", (conv_dim,)),
                ("dt_bias", (heads // tp,)), ("A_log", (heads // tp,)),
                ("D", ((d_inner if D_has_hdim else heads) // tp,)),
                ("in_proj.weight", ((2 * d_inner + 2 * groups * state + heads) // tp, d_model))]
    if rmsnorm:
        expected.append(("norm.weight", (d_inner // tp,)))
    return expected + [("out_proj.weight", (d_model, d_inner // tp))]


CASES = {
    "tiny": (dict(hidden=16, heads=4, head_dim=8, groups=2, state=6), {}),
    "tiny-Dhdim-nonorm": (dict(hidden=16, heads=4, head_dim=8, groups=2, state=6), dict(D_has_hdim=True, rmsnorm=False)),
    "nemotron-h": (dict(hidden=2688, heads=64, head_dim=64, groups=8, state=128), {}),
}


@pytest.mark.parametrize("case", CASES)
def test_parameters_match_megatron_mamba_mixer(pg_collection, case):
    dims, kwargs = CASES[case]
    config = make_config(**dims, dtype=torch.bfloat16, perform_initialization=case != "nemotron-h")
    mixer = make_mixer(pg_collection, config=config, **kwargs)
    dims["d_model"] = dims.pop("hidden")
    expected = mamba_mixer_parameters(**dims, **kwargs)
    assert [(n, tuple(p.shape)) for n, p in mixer.named_parameters()] == expected
    if case == "nemotron-h":
        assert dict(expected)["in_proj.weight"] == (10304, 2688) and dict(expected)["conv1d_weight"][0] == 6144

    # dtypes: A_log and D are created in fp32, everything else in params_dtype.
    assert {n: p.dtype for n, p in mixer.named_parameters()} == {
        n: torch.float32 if n in ("A_log", "D") else torch.bfloat16 for n, _ in expected}
    # The local linears add an (empty) _extra_state entry each; nothing else beyond the parameters.
    keys = [n for n, _ in expected]
    keys.insert(keys.index("in_proj.weight") + 1, "in_proj._extra_state")
    assert list(mixer.state_dict()) == keys + ["out_proj._extra_state"]
    # Tensor-parallel attributes used by the optimizer and resharding.
    for n, p in mixer.named_parameters():
        if n in ("conv1d_weight", "conv1d_bias", "dt_bias", "A_log", "D", "norm.weight"):
            assert p.tensor_model_parallel and p.partition_dim == 0, n
    d_inner, gn = dims["heads"] * dims["head_dim"], dims["groups"] * dims["state"]
    assert mixer.in_proj.weight.partition_sizes == [d_inner, d_inner, gn, gn, dims["heads"]]
    assert mixer.conv1d_weight.partition_sizes == mixer.conv1d_bias.partition_sizes == [d_inner, gn, gn]


def test_initialization_and_state_dict_match_the_real_mamba_mixer(pg_collection, monkeypatch):
    """Build megatron's own MambaMixer by lifting its kernel-import guard (its constructor needs no kernel;
    mamba_ssm's RMSNormGated is stood in for by our norm class): with equal seeds both draw equal weights,
    and state dicts and distributed-checkpoint keys are interchangeable."""
    from megatron.core.ssm import mamba_context_parallel, mamba_mixer
    from mimo.providers.nemotron.mamba_mixer import GatedGroupRMSNorm

    class StandInRMSNormGated(GatedGroupRMSNorm):
        def __init__(self, hidden_size, eps, group_size, norm_before_gate, device, dtype):
            super().__init__(hidden_size, group_size, eps=eps, device=device, dtype=dtype)

    monkeypatch.setattr(mamba_mixer, "HAVE_MAMBA_SSM", True)
    monkeypatch.setattr(mamba_mixer, "HAVE_EINOPS", True)
    monkeypatch.setattr(mamba_context_parallel, "HAVE_EINOPS", True)
    monkeypatch.setattr(mamba_mixer, "ExtendedRMSNorm", StandInRMSNormGated)
    config = make_config()
    seed_everything(7, tp_rank=0, ep_rank=0, etp_rank=0)
    real = mamba_mixer.MambaMixer(config, LOCAL_SPEC, d_model=16, pg_collection=pg_collection)
    ours = make_mixer(pg_collection, config=config, seed=7)

    real_sd, our_sd = real.state_dict(), ours.state_dict()
    assert list(real_sd) == list(our_sd)
    for k, v in real_sd.items():
        if v is not None:
            assert v.shape == our_sd[k].shape and v.dtype == our_sd[k].dtype, k
            torch.testing.assert_close(v, our_sd[k], rtol=0, atol=0, msg=k)
    fresh = make_mixer(pg_collection, config=config, seed=8)
    fresh.load_state_dict(real_sd, strict=True)
    torch.testing.assert_close(fresh(torch.ones(3, 1, 16))[0], ours(torch.ones(3, 1, 16))[0])

    metadata = {"dp_cp_group": pg_collection.dp_cp}
    real_sh = real.sharded_state_dict("layer.mixer.", metadata=dict(metadata))
    our_sh = ours.sharded_state_dict("layer.mixer.", metadata=dict(metadata))
    assert list(real_sh) == list(our_sh)
    for k in real_sh:
        assert type(real_sh[k]) is type(our_sh[k]) and real_sh[k].key == our_sh[k].key, k
