"""Adapters on grouped-GEMM experts (core/adapters/grouped_experts.py), one process, fp32: the tiny Nemotron
(squared-ReLU experts) and the tiny Qwen3.5 MoE (SwiGLU experts: fc1's gate rows, then its linear rows) with mimo's
grouped-GEMM experts (`expert_gemm=grouped_mm`) and the same adapters give megatron-core SequentialMLP's outputs
and adapter gradients, in every expert layout and with the per-expert adapters held by the experts module as
transformer-engine's grouped experts hold them; a few steps train alike; checkpoint keys are SequentialMLP's (a
gated fc1's B in gate and linear parts); merging folds held adapters into the expert weights; what grouped
experts cannot adapt is one line."""

from __future__ import annotations

import contextlib

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
NEMOTRON, QWEN = "nemotron-moe-vlm-tiny", "qwen3.5-vl-moe-tiny"  # squared-ReLU and SwiGLU experts, 4 each


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


def _build(expert_gemm, layout, targets=TARGETS, provider=NEMOTRON):
    plan = prepare(RunConfig(provider=provider, provider_settings=[f"expert_gemm={expert_gemm}"],
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


def _adapted(expert_gemm, layout, monkeypatch, hold=False, provider=NEMOTRON):
    """The model with adapters whose B are drawn by name (the same in every build), its output and the adapter
    gradients of a backward (main_grad, keyed by SequentialMLP's names)."""
    with monkeypatch.context() as patch:
        if hold:  # per-expert adapters held by the experts module, as on transformer-engine's grouped experts
            patch.setattr(grouped_experts, "holds_per_expert", lambda experts: True)
        plan, model, batch = _build(expert_gemm, layout, provider=provider)
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


@pytest.mark.parametrize("provider, layout, hold", [
    (NEMOTRON, "shared", False), (NEMOTRON, "per-expert", False), (NEMOTRON, "per-expert", True),
    (NEMOTRON, "shared-outer", False), (NEMOTRON, "shared-outer", True),
    (QWEN, "shared", False), (QWEN, "per-expert", True), (QWEN, "shared-outer", True)],
    ids=["shared", "per-expert", "per-expert-held", "shared-outer", "shared-outer-held", "qwen-shared",
         "qwen-per-expert-held", "qwen-shared-outer-held"])
def test_grouped_experts_with_adapters_give_sequential_mlps_outputs_and_gradients(world, monkeypatch, provider, layout,
                                                                                   hold):
    reference, ref_out, ref_grads, ref_calls = _adapted("megatron", layout, monkeypatch, provider=provider)
    model, out, grads, calls = _adapted("grouped_mm", layout, monkeypatch, hold, provider)
    layers = _experts(model)
    assert layers and all(type(e).__name__.startswith("LoRAGroupedMM") and e.grouped_mm for e in layers)
    # the grouped forward ran once per MoE layer, each with both adapter terms; megatron's path runs none
    assert not ref_calls and len(calls) == len(layers) and all(len(t) == 2 and all(t) for t in calls)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert (out - ref_out).abs().max() <= 1e-5 * ref_out.abs().max()
    assert grads.keys() == ref_grads.keys()
    expert_grads = [n for n in grads if ".experts." in n]
    # fc1, fc2; a, b; experts (shared-outer: each expert's inner half, one outer half)
    assert len(expert_grads) == len(layers) * 2 * {"shared": 2, "per-expert": 2 * 4, "shared-outer": 4 + 1}[layout]
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        if ".experts." in name:
            assert grads[name].abs().sum() > 0, name
    # checkpoint keys and shapes: the SequentialMLP layout's; a gated fc1's B (the experts' own, or the shared
    # one) saved in its gate and linear rows, as megatron-core saves the weight's
    keys = _adapter_keys(model)
    assert keys == _adapter_keys(reference)
    fc1 = {key.rpartition("linear_fc1")[2].removeprefix(".lora") for key, *_ in keys if ".experts." in key}
    fc1_b = {tail for tail in fc1 if tail.startswith(".b")}
    gated = layers[0].config.gated_linear_unit
    assert gated == (provider == QWEN) and fc1_b == ({".b.part0", ".b.part1"} if gated else {".b"}), fc1_b


def _adapter_keys(model):
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = model.sharded_state_dict()
    apply_factories(state)
    return sorted((e.key, tuple(e.global_shape), tuple(e.global_offset), e.replica_id)
                  for e in nested_values(state) if isinstance(e, ShardedTensor) and "lora" in e.key)


def _train(expert_gemm, layout, steps=4, provider=NEMOTRON, monkeypatch=None):
    with monkeypatch.context() if monkeypatch else contextlib.nullcontext() as patch:
        if patch:  # per-expert adapters held by the experts module
            patch.setattr(grouped_experts, "holds_per_expert", lambda experts: True)
        plan, model, batch = _build(expert_gemm, layout, provider=provider)
    optimizer = build_optimizer(plan.config.optimizer, model=model, params_dtype=torch.float32)
    return train_steps(model, optimizer, lambda: _forward(model, batch).mean(), steps)


@pytest.mark.parametrize("provider, layout, hold", [(NEMOTRON, "shared", False), (NEMOTRON, "per-expert", False),
                                                    (NEMOTRON, "shared-outer", False), (QWEN, "per-expert", True)],
                         ids=["shared", "per-expert", "shared-outer", "qwen-per-expert-held"])
def test_a_lora_run_on_grouped_experts_learns_as_on_sequential_mlp(world, monkeypatch, provider, layout, hold):
    grouped = _train("grouped_mm", layout, provider=provider, monkeypatch=monkeypatch if hold else None)
    sequential = _train("megatron", layout, provider=provider)
    assert grouped[-1] < grouped[0]
    assert grouped == pytest.approx(sequential, rel=1e-5)


@pytest.mark.parametrize("provider, hold", [(NEMOTRON, False), (NEMOTRON, True), (QWEN, True)],
                         ids=["linears", "held", "qwen-held"])
def test_merging_folds_grouped_expert_adapters_into_the_expert_weights(world, monkeypatch, provider, hold):
    model, adapted, _, _ = _adapted("grouped_mm", "per-expert", monkeypatch, hold, provider)
    assert merge_adapters(model) > 0
    assert not adapter_parameters(model)
    assert all(type(e) is grouped_mm_moe.GroupedMMSequentialMLP for e in _experts(model))
    _, _, batch = _build("megatron", "shared", "language:linear_qkv", provider)  # the same batch: the data's seed
    with torch.no_grad():
        merged = _forward(model, batch)
    assert (merged - adapted).abs().max() <= 4e-6 * adapted.abs().max()


def test_experts_off_the_grouped_path_are_refused_in_one_line(world):
    """Grouped experts without per-expert linears (transformer-engine's) kept off mimo's grouped GEMMs by FP8 take
    adapters on transformer-engine's grouped linears (test_lora_te_grouped_linears.py); kept off by anything else
    (biases here), they are refused: one line naming why."""
    import copy

    _, model, _ = _build("grouped_mm", "shared", "language:linear_qkv")
    experts = _experts(model)[0]
    grouped_experts.check_grouped(experts, "layer 2")  # mimo's SequentialMLP: its linears take adapters
    del experts.local_experts
    grouped_experts.check_grouped(experts, "layer 2")  # on the grouped path
    experts.config = copy.copy(experts.config)
    experts.config.fp8 = "hybrid"
    experts.grouped_mm = experts.grouped_mm_obstacle() is None
    assert not experts.grouped_mm
    grouped_experts.check_grouped(experts, "layer 2")  # FP8 alone: on transformer-engine's grouped linears
    experts.config.add_bias_linear = True
    with pytest.raises(UsageError, match=r"run transformer-engine's grouped linears, not mimo's grouped GEMMs, "
                                         r"because of biases, where expert adapters do not run; change that") as err:
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


# shared-outer (--lora-experts shared-outer): fc1's A and fc2's B one per layer, the other halves per expert

def _outer_model(expert_gemm, monkeypatch, hold=False):
    """A shared-outer model (adapters on the routed experts alone) with every B drawn away from zero, and its first
    MoE layer's experts."""
    with monkeypatch.context() as patch:
        if hold:
            patch.setattr(grouped_experts, "holds_per_expert", lambda experts: True)
        plan, model, batch = _build(expert_gemm, "shared-outer", "language:experts")
    with torch.no_grad():
        for name, param in adapter_parameters(model):
            if name.endswith(".b"):
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return plan, model, batch, _experts(model)[0]


def _reference(experts, x, counts, probs):
    """The experts with shared-outer adapters written out expert by expert from their tensors (fp32):
    fc1 W_e x + s B_e (A x), fc2 W_e h + s B (A_e h). Returns the output and leaf copies of the adapter matrices."""
    fc1, fc2 = grouped_mm_moe.expert_weights(experts)
    own1, own2 = (grouped_experts.adapters_of(experts, fc) for fc in ("linear_fc1", "linear_fc2"))
    scale = own1[0].scale

    def leaf(tensor):
        return tensor.detach().clone().requires_grad_()

    leaves = {"a1": leaf(experts.lora_outer_linear_fc1.a), "b2": leaf(experts.lora_outer_linear_fc2.b),
              "b1": [leaf(lora.b) for lora in own1], "a2": [leaf(lora.a) for lora in own2]}
    outputs = []
    for e, (x_e, p_e) in enumerate(zip(x.split(counts), probs.split(counts))):
        up = x_e @ fc1[e].detach().T + scale * (x_e @ leaves["a1"].T) @ leaves["b1"][e].T
        h = experts.config.activation_func(up) * p_e.unsqueeze(-1)
        outputs.append(h @ fc2[e].detach().T + scale * (h @ leaves["a2"][e].T) @ leaves["b2"].T)
    return torch.cat(outputs), leaves


@pytest.mark.parametrize("expert_gemm, hold", [("megatron", False), ("grouped_mm", False), ("grouped_mm", True)],
                         ids=["sequential-mlp", "grouped", "grouped-held"])
def test_shared_outer_experts_compute_the_per_expert_reference(world, monkeypatch, expert_gemm, hold):
    _, model, _, experts = _outer_model(expert_gemm, monkeypatch, hold)
    counts = [3, 0, 5, 2]  # an expert without tokens too
    generator = torch.Generator().manual_seed(5)
    hidden = experts.config.hidden_size
    x = torch.randn(sum(counts), hidden, generator=generator, requires_grad=True)
    probs = torch.rand(sum(counts), generator=generator)
    upstream = torch.randn(sum(counts), hidden, generator=generator)
    ref_x = x.detach().clone().requires_grad_()
    reference, leaves = _reference(experts, ref_x, counts, probs)
    (reference * upstream).sum().backward()

    calls = []
    term = grouped_experts.shared_outer
    monkeypatch.setattr(grouped_experts, "shared_outer", lambda *args: calls.append(1) or term(*args))
    model.zero_grad_buffer()
    output, _ = experts(x, torch.tensor(counts), probs)
    (output * upstream).sum().backward()
    assert len(calls) == (2 if expert_gemm == "grouped_mm" else 0)  # both linears' terms in the grouped forward
    torch.testing.assert_close(output, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-6, atol=1e-6)
    own1, own2 = (grouped_experts.adapters_of(experts, fc) for fc in ("linear_fc1", "linear_fc2"))
    pairs = [(experts.lora_outer_linear_fc1.a, leaves["a1"]), (experts.lora_outer_linear_fc2.b, leaves["b2"])]
    pairs += [(lora.b, ref) for lora, ref in zip(own1, leaves["b1"])]
    pairs += [(lora.a, ref) for lora, ref in zip(own2, leaves["a2"])]
    for param, ref in pairs:
        torch.testing.assert_close(param.main_grad, ref.grad, rtol=1e-5, atol=1e-6)
    assert all(ref.grad.abs().sum() > 0 for i, (_, ref) in enumerate(pairs) if i not in (3, 7))  # expert 1: none
    assert leaves["b1"][1].grad.abs().sum() == 0 and leaves["a2"][1].grad.abs().sum() == 0


@pytest.mark.parametrize("expert_gemm", ["megatron", "grouped_mm"])
def test_a_fresh_shared_outer_adapter_leaves_the_output_unchanged(world, expert_gemm):
    _, adapted, batch = _build(expert_gemm, "shared-outer", "language:experts")
    _, plain, _ = _build(expert_gemm, "shared", "language:linear_qkv")  # the same base, its B zero too
    assert any(n.endswith("lora_outer_linear_fc1.a") for n, _ in adapter_parameters(adapted))
    with torch.no_grad():
        assert torch.equal(_forward(adapted, batch), _forward(plain, batch))


@pytest.mark.parametrize("expert_gemm, hold", [("megatron", False), ("grouped_mm", False), ("grouped_mm", True)],
                         ids=["sequential-mlp", "grouped", "grouped-held"])
def test_merging_a_trained_shared_outer_adapter_gives_the_adapted_output(world, monkeypatch, expert_gemm, hold):
    with monkeypatch.context() as patch:
        if hold:
            patch.setattr(grouped_experts, "holds_per_expert", lambda experts: True)
        plan, model, batch = _build(expert_gemm, "shared-outer", "language:experts")
    with torch.no_grad():
        fresh = _forward(model, batch)
    optimizer = build_optimizer(plan.config.optimizer, model=model, params_dtype=torch.float32)
    train_steps(model, optimizer, lambda: _forward(model, batch).mean(), 2)
    with torch.no_grad():
        adapted = _forward(model, batch)
        assert merge_adapters(model) > 0
        assert not adapter_parameters(model)
        merged = _forward(model, batch)
    scale = adapted.abs().max()
    assert (adapted - fresh).abs().max() > 1e-3 * scale  # training moved the experts' B
    assert (merged - adapted).abs().max() <= 2e-6 * scale


@pytest.mark.parametrize("expert_gemm, hold", [("megatron", False), ("grouped_mm", True)], ids=["linears", "held"])
def test_shared_outer_halves_are_dense_and_the_experts_own_halves_expert_parameters(world, monkeypatch, expert_gemm,
                                                                                      hold):
    _, model, _, _ = _outer_model(expert_gemm, monkeypatch, hold)
    params = {n: p for n, p in adapter_parameters(model) if ".experts." in n}
    outer = {n for n in params if ".lora_outer_linear_fc" in n}
    assert {".".join(n.split(".")[-2:]) for n in outer} == {"lora_outer_linear_fc1.a", "lora_outer_linear_fc2.b"}
    assert len(outer) == 2 * len(_experts(model)) and len(params) == len(outer) * (1 + 4)
    # megatron-core DDP: `allreduce` False marks an expert parameter, which goes into its expert-parallel buffers
    # (reduced over expert-data-parallel); the rest into the dense ones (the whole data-parallel group)
    assert all(params[n].allreduce for n in outer)
    assert not any(p.allreduce for n, p in params.items() if n not in outer)
    ddp = next(m for m in model.modules() if getattr(m, "expert_parallel_buffers", None))
    assert {id(p) for b in ddp.buffers for p in b.params} == {id(params[n]) for n in outer}
    assert {id(p) for b in ddp.expert_parallel_buffers for p in b.params} == {
        id(p) for n, p in params.items() if n not in outer}
    assert {n[-1] for n in params if n not in outer and "fc1" in n} == {"b"}  # fc1: B_e own, fc2: A_e own
    assert {n[-1] for n in params if n not in outer and "fc2" in n} == {"a"}
    keys = {key: (shape, offset) for key, shape, offset, _ in _adapter_keys(model) if ".experts." in key}
    layer = next(k for k in keys if k.endswith("lora_outer_linear_fc1.a")).split(".mlp.")[0]
    # the experts' own halves under per-expert's keys, with the global expert axis; the shared ones one tensor
    assert {k.split(".mlp.")[1] for k in keys if k.startswith(f"{layer}.")} == {
        "experts.experts.linear_fc1.lora.b", "experts.experts.linear_fc2.lora.a", "experts.lora_outer_linear_fc1.a",
        "experts.lora_outer_linear_fc2.b"}
    assert keys[f"{layer}.mlp.experts.experts.linear_fc1.lora.b"][0][0] == 4
    assert len(keys[f"{layer}.mlp.experts.lora_outer_linear_fc1.a"][0]) == 2


def test_the_peft_export_refuses_shared_outer_adapters_in_one_line(world):
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from mimo.core.checkpoint.peft_export import refuse_shared_outer

    def keys(layout):
        _, model, _ = _build("megatron", layout, "language:experts")
        return [t.key for t in nested_values(model.sharded_state_dict()) if hasattr(t, "key")]

    refuse_shared_outer(keys("per-expert"), "MERGE")
    with pytest.raises(UsageError, match=r"--lora-experts shared-outer .* PEFT's per-expert A and B cannot "
                                         r"represent; export the merged model instead \(MERGE\) or train with "
                                         r"--lora-experts shared or per-expert") as err:
        refuse_shared_outer(keys("shared-outer"), "MERGE")
    assert "\n" not in str(err.value)
