"""Routed experts as torch grouped GEMMs (plugins/kit/grouped_mm_moe.py, Nemotron's `expert_gemm` setting):
`grouped_experts` equals a per-expert loop in values and gradients (fp32, bf16, experts without tokens; plain and
gated activations), grouped SequentialMLP experts equal megatron-core's for the config's gated activations; the
Nemotron model built with `expert_gemm=grouped_mm` uses the grouped experts and the device-counts dispatcher, keeps
megatron's parameters and checkpoint keys, and trains like `expert_gemm=megatron`; other specs are left alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from grouped_mm_pair import build, forward_backward_pair, sharded_keys
from helpers import read_metrics, run_mimo, world_of_one
from mimo.plugins.kit.expert_storage import pack_contiguously, packed_view
from mimo.plugins.kit.grouped_mm_moe import (
    DeviceCountsMoELayer, GroupedMMSequentialMLP, _DeviceCountsDispatcher, expert_weights, grouped_experts,
    with_grouped_mm_experts,
)
from mimo.plugins.kit.main_grad import stacked

ENV = {"OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1"}


# --------------------------------------------------------------------------------------------- the kernel


def _squared_relu(x):
    return F.relu(x).pow(2)


def _loop_reference(hidden, counts, probs, fc1, fc2, activation):
    """Expert by expert: its rows @ fc1[e].T, the activation times the routing probability, @ fc2[e].T."""
    outputs, start = [], 0
    for e, count in enumerate(counts.tolist()):
        rows = slice(start, start + count)
        inner = activation(hidden[rows] @ fc1[e].T) * probs[rows].unsqueeze(-1)
        outputs.append(inner @ fc2[e].T)
        start += count
    return torch.cat(outputs)


def _swiglu(x):
    """fc1's gate rows first, then its linear rows (megatron-core's and Hugging Face's gate_up order)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _kit_swiglu():
    """The kit's activation for a SwiGLU TransformerConfig."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mimo.plugins.kit.grouped_mm_moe import expert_activation

    return expert_activation(TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1,
                                               gated_linear_unit=True, activation_func=F.silu))


def _leaves(dtype, counts, hidden_size, ffn, generator, gated=False):
    tokens, experts = int(counts.sum()), counts.numel()
    make = lambda *shape, scale=1.0: (torch.randn(*shape, generator=generator) * scale).to(dtype).requires_grad_()
    return (make(tokens, hidden_size), torch.rand(tokens, generator=generator).to(dtype).requires_grad_(),
            make(experts, (2 if gated else 1) * ffn, hidden_size, scale=hidden_size ** -0.5),
            make(experts, hidden_size, ffn, scale=ffn ** -0.5))


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("activation, reference_activation", [(_squared_relu, _squared_relu), (F.gelu, F.gelu),
                                                                 (_kit_swiglu(), _swiglu)],
                         ids=["squared_relu", "gelu", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_experts_equals_a_loop_over_experts(dtype, activation, reference_activation):
    """`grouped_experts` gives a per-expert loop's output and input/probs/weight gradients (experts without tokens
    included: their weight gradients are exactly zero); gated (SwiGLU): fc1 has twice the rows."""
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([0, 5, 3, 0, 9, 1, 6, 0])  # first, middle and last expert without tokens
    hidden_size, ffn = 16, 24  # strides are multiples of 16 bytes in fp32 and bf16
    leaves = _leaves(dtype, counts, hidden_size, ffn, generator, gated=reference_activation is _swiglu)
    upstream = torch.randn(int(counts.sum()), hidden_size, generator=generator).to(dtype)

    out = grouped_experts(*leaves[:1], counts, *leaves[1:], activation)
    assert out.dtype == dtype and out.shape == (int(counts.sum()), hidden_size)
    got_grads = torch.autograd.grad(out, leaves, upstream)

    # the reference in fp32 (bf16: from the same bf16 values, upcast)
    reference_leaves = [t.detach().float().requires_grad_() for t in leaves]
    hidden, probs, fc1, fc2 = reference_leaves
    reference = _loop_reference(hidden, counts, probs, fc1, fc2, reference_activation)
    reference_grads = torch.autograd.grad(reference, reference_leaves, upstream.float())

    if dtype == torch.float32:
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
        for name, got, want in zip(("input", "probs", "fc1", "fc2"), got_grads, reference_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    else:
        assert _rel(out, reference) < 2e-2
        for name, got, want in zip(("input", "probs", "fc1", "fc2"), got_grads, reference_grads):
            assert _rel(got, want) < 3e-2, name
    for e in (counts == 0).nonzero().flatten().tolist():  # no tokens: no gradient at all
        assert got_grads[2][e].abs().sum() == 0 and got_grads[3][e].abs().sum() == 0
    for e in (counts > 0).nonzero().flatten().tolist():
        assert got_grads[2][e].abs().sum() > 0 and got_grads[3][e].abs().sum() > 0


def test_grouped_experts_takes_counts_as_any_integer_tensor():
    """The token counts may come as int64 (megatron's dispatcher) or int32: the same result."""
    generator = torch.Generator().manual_seed(1)
    counts = torch.tensor([4, 0, 4])
    hidden, probs, fc1, fc2 = _leaves(torch.float32, counts, 8, 16, generator)
    a = grouped_experts(hidden, counts, probs, fc1, fc2, F.gelu)
    b = grouped_experts(hidden, counts.to(torch.int32), probs, fc1, fc2, F.gelu)
    assert torch.equal(a, b)


@pytest.mark.parametrize("activation, offset, clamp", [("silu", 0.0, None), ("quick_gelu", 1.0, 0.5),
                                                       ("squared_relu", 0.0, None)],
                         ids=["swiglu", "clamped-geglu", "squared_relu"])
def test_grouped_sequential_experts_compute_megatrons_activation(world, activation, offset, clamp):
    """GroupedMMSequentialMLP against megatron-core's SequentialMLP with the same weights, for the config's gated
    activations (glu_linear_offset and activation_func_clamp_value included; the clamp cuts most values here) and a
    plain one: the same outputs and input, probability and weight gradients (fp32)."""
    import torch.distributed as dist
    from megatron.core.activations import squared_relu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    function = {"silu": F.silu, "quick_gelu": quick_gelu, "squared_relu": squared_relu}[activation]
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, ffn_hidden_size=24,
                               moe_ffn_hidden_size=24, num_moe_experts=4,
                               gated_linear_unit=activation != "squared_relu",
                               activation_func=function, glu_linear_offset=offset, activation_func_clamp_value=clamp,
                               add_bias_linear=False, use_cpu_initialization=True, bias_activation_fusion=False)
    group = dist.group.WORLD
    pgc = ProcessGroupCollection(tp=group, ep=group, expt_tp=group, expt_dp=group)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    megatron = SequentialMLP(4, config, submodules, pg_collection=pgc)
    grouped = GroupedMMSequentialMLP(4, config, submodules, pg_collection=pgc)
    grouped.load_state_dict(megatron.state_dict())
    assert grouped.grouped_mm
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 9, 6])
    # fc1's outputs of about unit size (weights of std 0.02): the clamp cuts most of them
    hidden, probs = torch.randn(20, 16, generator=generator) * 12, torch.rand(20, generator=generator)
    upstream = torch.randn(20, 16, generator=generator)
    results = []
    for experts in (grouped, megatron):
        inputs = (hidden.clone().requires_grad_(), probs.clone().requires_grad_())
        out, _ = experts(inputs[0], counts, inputs[1])
        out.backward(upstream)
        results.append((out.detach(), inputs[0].grad, inputs[1].grad,
                        [w.grad for weights in expert_weights(experts) for w in weights]))
    (out_g, dx_g, dp_g, dw_g), (out_m, dx_m, dp_m, dw_m) = results
    torch.testing.assert_close(out_g, out_m, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx_g, dx_m, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dp_g, dp_m, rtol=1e-5, atol=1e-6)
    for got, want in zip(dw_g, dw_m):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------- the spec


def test_packed_expert_weights_are_stacked_without_a_copy():
    """pack_contiguously moves a layer's weights into one tensor, keeping their objects and values; `stacked` then
    hands the grouped GEMM that tensor itself, with torch.stack's gradients; weights apart are stacked as before."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(3, 4, generator=generator)) for _ in range(4)]
    weights[1].tag = "kept"
    values, objects = torch.stack([w.detach().clone() for w in weights]), list(weights)
    assert packed_view(weights) is None
    pack_contiguously(weights)
    view = packed_view(weights)
    assert view is not None and torch.equal(view, values) and view.data_ptr() == weights[0].data_ptr()
    assert all(a is b for a, b in zip(weights, objects)) and weights[1].tag == "kept"
    x = torch.randn(2, 4, generator=generator)
    result = stacked(weights)
    assert result.data_ptr() == weights[0].data_ptr()  # no copy
    (result @ x.t()).square().sum().backward()
    reference = [torch.nn.Parameter(v.clone()) for v in values]
    (torch.stack(reference) @ x.t()).square().sum().backward()
    assert all(torch.equal(w.grad, r.grad) for w, r in zip(weights, reference))
    with torch.no_grad():
        view[2].add_(1.0)  # the parameters are its rows
    assert torch.equal(weights[2], values[2] + 1.0)
    weights[3].data = weights[3].data.clone()  # moved apart: stacked again, by copy
    assert packed_view(weights) is None and stacked(weights).data_ptr() != weights[0].data_ptr()
    assert packed_view(weights[:3]) is not None


def test_with_grouped_mm_experts_leaves_other_specs_unchanged():
    """A spec whose mlp is not a MoELayer partial (a dense MLP layer, an attention layer) comes back as it was;
    megatron-core's local MoE spec becomes DeviceCountsMoELayer with GroupedMMSequentialMLP experts."""
    from mimo.providers.nemotron.specs import hybrid_stack_spec

    local = hybrid_stack_spec("local", conv_kernel=4, num_experts=4, expert_gemm="megatron").submodules
    for spec in (local.mlp_layer, local.attention_layer):
        assert with_grouped_mm_experts(spec) is spec
    # a MoELayer partial whose experts class has no grouped variant: unchanged too
    import functools

    from megatron.core.transformer.mlp import MLP

    moe_mlp = local.moe_layer.submodules.mlp
    other_experts = dataclasses.replace(moe_mlp.keywords["submodules"], experts=functools.partial(MLP))
    odd = dataclasses.replace(local.moe_layer, submodules=dataclasses.replace(
        local.moe_layer.submodules, mlp=functools.partial(moe_mlp.func, **{**moe_mlp.keywords,
                                                                           "submodules": other_experts})))
    assert with_grouped_mm_experts(odd) is odd
    grouped = with_grouped_mm_experts(local.moe_layer)
    assert grouped is not local.moe_layer
    mlp = grouped.submodules.mlp
    assert mlp.func is DeviceCountsMoELayer and mlp.keywords["submodules"].experts.func is GroupedMMSequentialMLP
    # the original spec (megatron-core's objects) is not changed in place
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    assert local.moe_layer.submodules.mlp.func is MoELayer
    assert local.moe_layer.submodules.mlp.keywords["submodules"].experts.func is SequentialMLP
    # and the setting's spec is this one
    chosen = hybrid_stack_spec("local", conv_kernel=4, num_experts=4, expert_gemm="grouped_mm").submodules
    assert chosen.moe_layer.submodules.mlp.func is DeviceCountsMoELayer
    assert hybrid_stack_spec("local", 4, 4, expert_gemm="auto").submodules.moe_layer.submodules.mlp.func is MoELayer


def test_with_grouped_mm_experts_leaves_a_spec_without_mlp_unchanged():
    """A layer spec with no `mlp` submodule at all (megatron-core's Mamba layer) comes back unchanged."""
    from mimo.providers.nemotron.specs import hybrid_stack_spec

    mamba = hybrid_stack_spec("local", conv_kernel=4, num_experts=4, expert_gemm="megatron").submodules.mamba_layer
    assert with_grouped_mm_experts(mamba) is mamba


# --------------------------------------------------------------------------------------------- the model


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


def _build(expert_gemm):
    return build("nemotron-moe-vlm-tiny", expert_gemm)


def test_nemotron_grouped_mm_model_uses_grouped_experts_and_keeps_megatrons_checkpoint(world, monkeypatch):
    """expert_gemm=grouped_mm builds DeviceCountsMoELayers with grouped SequentialMLP experts and the device-counts
    dispatcher, with megatron's parameters (same init), state-dict and sharded-checkpoint keys, and outputs."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    plan, run, grouped = _build("grouped_mm")
    _, _, megatron = _build("megatron")

    layers = [m for m in grouped.modules() if isinstance(m, DeviceCountsMoELayer)]
    assert layers
    assert len(layers) == sum(isinstance(m, MoELayer) for m in grouped.modules())
    for layer in layers:
        assert type(layer.experts) is GroupedMMSequentialMLP and layer.experts.grouped_mm is True
        assert layer.experts.num_local_experts == 4
        # each linear's expert weights lie in one tensor, after DDP's wrapping too: the GEMMs take them uncopied
        assert all(packed_view(weights) is not None for weights in expert_weights(layer.experts))
        assert type(layer.token_dispatcher) is _DeviceCountsDispatcher
        moved = layer.experts.to(torch.float64)  # a move (CPU-drawn weights to the GPU) lays them out again
        assert all(packed_view(weights) is not None and weights[0].dtype == torch.float64
                   for weights in expert_weights(moved))
        layer.experts.to(torch.float32)
    plain = [m for m in megatron.modules() if isinstance(m, MoELayer)]
    assert len(plain) == len(layers) and not any(isinstance(m, DeviceCountsMoELayer) for m in plain)
    assert all(type(m.experts) is SequentialMLP and type(m.token_dispatcher) is MoEAlltoAllTokenDispatcher
               for m in plain)

    grouped_state, megatron_state = grouped.state_dict(), megatron.state_dict()
    assert list(grouped_state) == list(megatron_state)
    weights = [n for n, v in grouped_state.items() if isinstance(v, torch.Tensor)]
    assert all(torch.equal(grouped_state[n], megatron_state[n]) for n in weights)  # same initialization
    assert sharded_keys(grouped.sharded_state_dict()) == sharded_keys(megatron.sharded_state_dict())
    from mimo.providers.nemotron.checkpoint import nemotron_sharded_state_dict

    assert sharded_keys(nemotron_sharded_state_dict(grouped)) == sharded_keys(nemotron_sharded_state_dict(megatron))

    # the same weights give the same per-token losses and gradients (a batch's forward and backward)
    calls, results = forward_backward_pair(plan, run, grouped, megatron, monkeypatch)
    assert calls == len(layers)  # the grouped forward ran, not its parent's fallback: one call per MoE layer
    (out_g, grads_g), (out_m, grads_m) = results
    torch.testing.assert_close(out_g, out_m, rtol=1e-5, atol=1e-6)
    assert grads_g.keys() == grads_m.keys()
    experts = [n for n in grads_g if ".experts." in n]
    assert experts and any(grads_g[n].abs().sum() > 0 for n in experts)
    for name in grads_g:
        torch.testing.assert_close(grads_g[name], grads_m[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------------------------- training


def _train(tmp_path, expert_gemm):
    metrics = tmp_path / f"{expert_gemm}.jsonl"
    result = run_mimo("run", "--provider", "nemotron-moe-vlm-tiny", "--device", "cpu", "--set", "backend=local",
                      "--set", f"expert_gemm={expert_gemm}", "--train-iters", "4", "--micro-batch-size", "2",
                      "--num-microbatches", "2", "--log-interval", "1", "--seed", "4", "--metrics-file", str(metrics),
                      env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(metrics)


def test_nemotron_trains_alike_with_grouped_mm_and_megatron_experts(tmp_path):
    """`mimo run` with expert_gemm=grouped_mm logs the losses, grad norms and MoE losses of expert_gemm=megatron."""
    grouped, megatron = _train(tmp_path, "grouped_mm"), _train(tmp_path, "megatron")
    assert [r["iteration"] for r in grouped] == [r["iteration"] for r in megatron] == [1, 2, 3, 4]
    for ref, got in zip(megatron, grouped):
        keys = ["lm_loss", "grad_norm", "grad_norm_images", "grad_norm_language"]
        keys += [k for k in ref if k.startswith("moe") or "aux" in k or "z_loss" in k]
        for key in keys:
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-9), (ref["iteration"], key)
    assert grouped[-1]["lm_loss"] != grouped[0]["lm_loss"]  # the model did train
