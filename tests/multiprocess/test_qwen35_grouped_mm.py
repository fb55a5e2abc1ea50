"""Qwen3.5's routed experts as the kit's grouped GEMMs (`expert_gemm=grouped_mm`; plugins/kit/grouped_mm_moe.py):
SwiGLU experts (fc1's gate rows, then its linear rows) beside the gated shared expert. The model keeps megatron's
parameters and checkpoint keys, computes the outputs and gradients of megatron-core's experts, and trains alike."""

from __future__ import annotations

import pytest
import torch

from grouped_mm_pair import build, forward_backward_pair, sharded_keys
from helpers import read_metrics, run_mimo, world_of_one
from mimo.plugins.kit.expert_storage import packed_view
from mimo.plugins.kit.grouped_mm_moe import (
    DeviceCountsMoELayer, GroupedMMSequentialMLP, _DeviceCountsDispatcher, expert_weights,
)

ENV = {"OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1"}
PROVIDER = "qwen3.5-vl-moe-tiny"


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


def _build(expert_gemm):
    return build(PROVIDER, expert_gemm)


def test_qwen_grouped_mm_experts_compute_megatrons_swiglu_experts(world, monkeypatch):
    """expert_gemm=grouped_mm: DeviceCountsMoELayers whose grouped SequentialMLP experts take the gated fc1 whole
    ([E, 2 ffn, H], gate rows first) and keep megatron's parameters (same initialization), state-dict and sharded
    keys; a batch's forward and backward give megatron's outputs and gradients (fp32), shared expert and its gate
    included."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    plan, run, grouped = _build("grouped_mm")
    _, _, megatron = _build("megatron")

    layers = [m for m in grouped.modules() if isinstance(m, MoELayer)]
    assert len(layers) == len(plan.settings.layer_pattern)
    for layer in layers:
        assert type(layer) is DeviceCountsMoELayer and type(layer.token_dispatcher) is _DeviceCountsDispatcher
        assert type(layer.experts) is GroupedMMSequentialMLP and layer.experts.grouped_mm is True
        assert layer.config.gated_linear_unit and layer.shared_experts is not None
        fc1, fc2 = expert_weights(layer.experts)
        ffn = plan.settings.moe_ffn_hidden_size
        assert fc1[0].shape == (2 * ffn, plan.settings.hidden_size) and fc2[0].shape == (plan.settings.hidden_size, ffn)
        assert packed_view(fc1) is not None and packed_view(fc2) is not None
    assert all(type(m) is MoELayer and type(m.experts) is SequentialMLP
               for m in megatron.modules() if isinstance(m, MoELayer))

    grouped_state, megatron_state = grouped.state_dict(), megatron.state_dict()
    assert list(grouped_state) == list(megatron_state)
    assert all(torch.equal(grouped_state[n], v) for n, v in megatron_state.items() if isinstance(v, torch.Tensor))
    assert sharded_keys(grouped.sharded_state_dict()) == sharded_keys(megatron.sharded_state_dict())

    calls, results = forward_backward_pair(plan, run, grouped, megatron, monkeypatch)
    assert calls == len(layers)  # the grouped forward ran, not its parent's fallback: one call per MoE layer
    (out_g, grads_g), (out_m, grads_m) = results
    torch.testing.assert_close(out_g, out_m, rtol=1e-5, atol=1e-6)
    assert grads_g.keys() == grads_m.keys()
    for part in (".experts.", ".shared_experts.", "gate_weight"):
        assert any(part in n and grads_g[n].abs().sum() > 0 for n in grads_g), part
    for name in grads_g:
        torch.testing.assert_close(grads_g[name], grads_m[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _train(tmp_path, expert_gemm, *extra):
    metrics = tmp_path / f"{expert_gemm}.jsonl"
    result = run_mimo("run", "--provider", PROVIDER, "--device", "cpu", "--set", "backend=local", "--set",
                      f"expert_gemm={expert_gemm}", "--train-iters", "4", "--micro-batch-size", "2",
                      "--num-microbatches", "2", "--log-interval", "1", "--seed", "4", "--metrics-file", str(metrics),
                      *extra, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(metrics)


@pytest.mark.parametrize("extra", [(), ("--lora-rank", "4", "--lora-experts", "per-expert")],
                         ids=["full", "lora-per-expert"])
def test_qwen_trains_alike_with_grouped_mm_and_megatron_experts(tmp_path, extra):
    """`mimo run` of the tiny MoE model with expert_gemm=grouped_mm logs the losses and grad norms (the
    load-balancing loss's gradient among them) of expert_gemm=megatron; so do LoRA adapters on every expert's fc1
    (gate and linear rows) and fc2, which the grouped forward adds beside the grouped GEMMs."""
    grouped, megatron = _train(tmp_path, "grouped_mm", *extra), _train(tmp_path, "megatron", *extra)
    assert [r["iteration"] for r in grouped] == [r["iteration"] for r in megatron] == [1, 2, 3, 4]
    for ref, got in zip(megatron, grouped):
        keys = ["lm_loss", "grad_norm", "grad_norm_images", "grad_norm_language"]
        keys += [k for k in ref if k.startswith("moe") or "aux" in k]
        for key in keys:
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-9), (ref["iteration"], key)
    assert grouped[-1]["lm_loss"] != grouped[0]["lm_loss"]  # the model did train
