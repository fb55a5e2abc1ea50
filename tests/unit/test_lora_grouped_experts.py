"""Adapters on grouped-GEMM experts (core/adapters/grouped_experts.py), one process, fp32: the tiny Nemotron with
mimo's grouped-GEMM experts (`expert_gemm=grouped_mm`) and the same adapters gives megatron-core SequentialMLP's
outputs and adapter gradients, in both expert layouts and with the per-expert adapters held by the experts module
as transformer-engine's grouped experts hold them; a few steps train alike; checkpoint keys are SequentialMLP's;
merging folds held adapters into the expert weights; what grouped experts cannot adapt is one line."""

from __future__ import annotations

import pytest
import torch

from helpers import train_steps, world_of_one
from mimo.core.adapters import grouped_experts
from mimo.core.adapters.apply import adapter_parameters, merge_adapters
from mimo.core.config import AdapterOptions, OptimizerOptions, RunConfig, TrainingOptions
from mimo.core.forward.batch_transfer import to_device
from mimo.core.parallel.optim import build_optimizer
from mimo.core.run.plan import prepare
from mimo.core.run.world import join
from mimo.errors import UsageError
from mimo.plugins.kit import grouped_mm_moe

CPU = torch.device("cpu")
TARGETS = "language:linear_qkv,in_proj,experts"


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


def _build(expert_gemm, layout, targets=TARGETS):
    plan = prepare(RunConfig(provider="nemotron-moe-vlm-tiny", provider_settings=[f"expert_gemm={expert_gemm}"],
                             training=TrainingOptions(device="cpu", micro_batch_size=2),
                             optimizer=OptimizerOptions(lr=0.05),
                             adapters=AdapterOptions(lora_rank=3, lora_targets=targets, lora_experts=layout)),
                   world_size=1)  # rank 3: fp32 strides of 12 bytes, which the grouped GEMM's padding handles
    run = join(plan)
    model = run.build_model()
    batch = next(iter(plan.hooks.data_provider(settings=plan.settings, ctx=run.data_context())))
    return plan, model, batch


def _forward(model, batch):
    inputs = to_device({k: v for k, v in batch.items() if k != "modality_inputs"}, CPU, torch.float32)
    output, _ = model(**inputs, modality_inputs=to_device(batch["modality_inputs"], CPU, torch.float32) or None)
    return output


def _experts(model):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m.experts for m in model.modules() if isinstance(m, MoELayer)]


def _canonical(name: str) -> str:
    """A held per-expert adapter's name as SequentialMLP's linears name theirs."""
    parts = name.split(".")
    if "lora_linear_fc1" in parts or "lora_linear_fc2" in parts:
        at = next(i for i, p in enumerate(parts) if p.startswith("lora_linear_fc"))
        if parts[at + 1].isdigit():
            return ".".join(parts[:at] + ["local_experts", parts[at + 1], parts[at][5:], "lora"] + parts[at + 2:])
    return name


def _adapted(expert_gemm, layout, monkeypatch, hold=False):
    """The model with adapters whose B are drawn by name (the same in every build), its output and the adapter
    gradients of a backward (main_grad, keyed by SequentialMLP's names)."""
    with monkeypatch.context() as patch:
        if hold:  # per-expert adapters held by the experts module, as on transformer-engine's grouped experts
            patch.setattr(grouped_experts, "holds_per_expert", lambda experts: True)
        plan, model, batch = _build(expert_gemm, layout)
    params = dict(adapter_parameters(model))
    with torch.no_grad():
        for name, param in params.items():
            if name.endswith(".b"):
                seed = sum(map(ord, _canonical(name)))
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)
    model.zero_grad_buffer()
    calls = []
    kernel = grouped_mm_moe.grouped_experts
    with monkeypatch.context() as patch:
        def counted(*args, **kwargs):  # the adapter terms it was handed (its eighth argument)
            calls.append(kwargs.get("adapters", args[7] if len(args) > 7 else ()))
            return kernel(*args, **kwargs)

        patch.setattr(grouped_mm_moe, "grouped_experts", counted)
        output = _forward(model, batch)
        output.sum().backward()
    grads = {_canonical(n): p.main_grad.clone() for n, p in params.items()}
    return model, output.detach(), grads, calls


@pytest.mark.parametrize("layout, hold", [("shared", False), ("per-expert", False), ("per-expert", True)],
                         ids=["shared", "per-expert", "per-expert-held"])
def test_grouped_experts_with_adapters_give_sequential_mlps_outputs_and_gradients(world, monkeypatch, layout, hold):
    reference, ref_out, ref_grads, ref_calls = _adapted("megatron", layout, monkeypatch)
    model, out, grads, calls = _adapted("grouped_mm", layout, monkeypatch, hold)
    layers = _experts(model)
    assert layers and all(type(e).__name__.startswith("LoRAGroupedMM") and e.grouped_mm for e in layers)
    # the grouped forward ran once per MoE layer, each with both adapter terms; megatron's path runs none
    assert not ref_calls and len(calls) == len(layers) and all(len(t) == 2 and all(t) for t in calls)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert (out - ref_out).abs().max() <= 1e-5 * ref_out.abs().max()
    assert grads.keys() == ref_grads.keys()
    expert_grads = [n for n in grads if ".experts." in n]
    assert len(expert_grads) == len(layers) * 2 * 2 * (1 if layout == "shared" else 4)  # fc1, fc2; a, b; experts
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        if ".experts." in name:
            assert grads[name].abs().sum() > 0, name
    # checkpoint keys and shapes: the SequentialMLP layout's
    assert _adapter_keys(model) == _adapter_keys(reference)


def _adapter_keys(model):
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = model.sharded_state_dict()
    apply_factories(state)
    return sorted((e.key, tuple(e.global_shape), tuple(e.global_offset), e.replica_id)
                  for e in nested_values(state) if isinstance(e, ShardedTensor) and "lora" in e.key)


def _train(expert_gemm, layout, steps=4):
    plan, model, batch = _build(expert_gemm, layout)
    optimizer = build_optimizer(plan.config.optimizer, model=model, params_dtype=torch.float32)
    return train_steps(model, optimizer, lambda: _forward(model, batch).mean(), steps)


@pytest.mark.parametrize("layout", ["shared", "per-expert"])
def test_a_lora_run_on_grouped_experts_learns_as_on_sequential_mlp(world, layout):
    grouped, sequential = _train("grouped_mm", layout), _train("megatron", layout)
    assert grouped[-1] < grouped[0]
    assert grouped == pytest.approx(sequential, rel=1e-5)


@pytest.mark.parametrize("hold", [False, True], ids=["linears", "held"])
def test_merging_folds_grouped_expert_adapters_into_the_expert_weights(world, monkeypatch, hold):
    model, adapted, _, _ = _adapted("grouped_mm", "per-expert", monkeypatch, hold)
    assert merge_adapters(model) > 0
    assert not adapter_parameters(model)
    assert all(type(e) is grouped_mm_moe.GroupedMMSequentialMLP for e in _experts(model))
    _, _, batch = _build("megatron", "shared", "language:linear_qkv")  # the same batch: the data's seed
    with torch.no_grad():
        merged = _forward(model, batch)
    assert (merged - adapted).abs().max() <= 4e-6 * adapted.abs().max()


def test_experts_off_the_grouped_path_are_refused_in_one_line(world):
    """Grouped experts without per-expert linears (transformer-engine's) that cannot run mimo's grouped GEMMs run
    transformer-engine's own grouped linears, which take no adapter: one line naming why."""
    import copy

    _, model, _ = _build("grouped_mm", "shared", "language:linear_qkv")
    experts = _experts(model)[0]
    grouped_experts.check_grouped(experts, "layer 2")  # mimo's SequentialMLP: its linears take adapters
    del experts.local_experts
    grouped_experts.check_grouped(experts, "layer 2")  # on the grouped path
    experts.config = copy.copy(experts.config)
    experts.config.fp8 = "hybrid"
    experts.grouped_mm = experts.grouped_mm_obstacle() is None
    with pytest.raises(UsageError, match=r"run transformer-engine's grouped linears, not mimo's grouped GEMMs, "
                                         r"because of FP8/FP4 \(no --fp8\); change that") as err:
        grouped_experts.check_grouped(experts, "layer 2")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("expert_gemm", ["grouped_mm", "megatron"])
def test_decoding_leaves_adapted_experts_on_their_own_forward(world, expert_gemm):
    """The decoder's one-token MoE path multiplies stacked base expert weights: layers whose experts have adapters
    keep their own forward (which adds them); without adapters on the experts the path takes every layer."""
    from mimo.core.generation.one_token_moe import OneTokenMoE

    _, adapted, _ = _build(expert_gemm, "per-expert")
    _, plain, _ = _build(expert_gemm, "shared", "language:linear_qkv")
    assert _experts(adapted) and not OneTokenMoE(adapted).layers
    assert OneTokenMoE(plain).complete and len(OneTokenMoE(plain).layers) == len(_experts(plain))
