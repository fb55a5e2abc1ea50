"""Expert adapters on transformer-engine's grouped linears (core/adapters/te_grouped_linears.py), the forward mimo's
GroupedMMExperts fall back to under FP8, on the CPU in fp32. transformer-engine is not needed: a stand-in experts
module runs TEGroupedMLP's unfused forward as adapters see it (each expert's rows padded with zeros to a multiple of
16 under FP8, `linear_fc1(x, m_splits)`, squared ReLU times the probabilities, `linear_fc2`, the padding dropped), its
grouped linears a per-expert loop. In every expert layout the fallback with adapters gives the grouped-GEMM path's
outputs, input gradients and adapter gradients for the same adapters (the same objects); pad rows get no term;
merging folds the adapters into weight0..N."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.activations import squared_relu

from mimo.core.adapters import experts as expert_adapters
from mimo.core.adapters.apply import merge_adapters
from mimo.core.adapters.lora import LoRA
from mimo.plugins.kit.grouped_mm_moe import _GroupedMMForward

EXPERTS, HIDDEN, FFN, RANK, PAD = 4, 8, 12, 3, 16
COUNTS = [5, 0, 17, 3]  # an expert without tokens, counts off the FP8 padding's multiple


class _OneRank:
    """A process group of one rank."""

    def size(self):
        return 1

    def rank(self):
        return 0


class _GroupedLinear(torch.nn.Module):
    """transformer-engine's GroupedLinear as megatron-core calls it: (x, m_splits) -> (out, None), weight0..N."""

    def __init__(self, in_features, out_features, generator):
        super().__init__()
        for i in range(EXPERTS):
            weight = torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5
            self.register_parameter(f"weight{i}", torch.nn.Parameter(weight, requires_grad=False))

    def forward(self, x, m_splits):
        parts = x.split(list(m_splits))
        return torch.cat([part @ getattr(self, f"weight{i}").T for i, part in enumerate(parts)]), None


def _pad(x, counts, padded):
    return torch.cat([torch.cat([part, part.new_zeros(p - n, *part.shape[1:])])
                      for part, n, p in zip(x.split(counts), counts, padded)])


def _unpad(x, counts, padded):
    return torch.cat([part[:n] for part, n in zip(x.split(padded), counts)])


class _TEGroupedMLP(torch.nn.Module):
    """TEGroupedMLP's unfused forward as its grouped linears see it."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.config = SimpleNamespace(fp8="hybrid", fp4=None, gated_linear_unit=False, add_bias_linear=False,
                                      moe_apply_probs_on_input=False, activation_func=squared_relu)
        self.num_local_experts = EXPERTS
        self.tp_group = self.ep_group = self.dp_group = _OneRank()
        self.linear_fc1 = _GroupedLinear(HIDDEN, FFN, generator)
        self.linear_fc2 = _GroupedLinear(FFN, HIDDEN, generator)

    def forward(self, hidden, tokens_per_expert, probs):
        counts = tokens_per_expert.tolist()
        padded = [-(-n // PAD) * PAD for n in counts]  # megatron-core's Fp8Padding
        hidden, probs = _pad(hidden, counts, padded), _pad(probs.unsqueeze(-1), counts, padded)
        up, _ = self.linear_fc1(hidden, padded)
        self.fc1_output, self.pad_rows = up.detach(), _pad(torch.ones(sum(counts)), counts, padded) == 0
        out, _ = self.linear_fc2(squared_relu(up) * probs, padded)
        return _unpad(out, counts, padded), None


class _Experts(_GroupedMMForward, _TEGroupedMLP):
    """mimo's GroupedMMExperts on the stand-in."""

    def __init__(self):
        super().__init__()
        self.grouped_mm = self._grouped_mm_eligible()


def _make_lora(sharding, weight, name, expert, linear=None):
    lora = LoRA(sharding, RANK, 2.0, 0.0, torch.float32, torch.device("cpu"), expert=expert)
    lora.initialize(7, name)
    with torch.no_grad():  # B away from zero, as after training
        lora.b.copy_(torch.randn(lora.b.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return lora


def _adapted(layout):
    experts = _Experts()
    expert_adapters.check_experts(experts, "layer 1")  # FP8 alone: adapted on the grouped linears
    expert_adapters.adapt_experts(experts, layout, _make_lora, "layer1.experts")
    return experts


def _run(experts, grouped_mm):
    """Output, input gradient and adapter gradients of one forward and backward."""
    x, counts, probs = _inputs()
    x.requires_grad_()
    upstream = torch.randn(sum(COUNTS), HIDDEN, generator=torch.Generator().manual_seed(4))
    params = [p for p in experts.parameters() if p.requires_grad]
    for param in params:
        param.grad = None
    experts.grouped_mm = grouped_mm
    out, _ = experts(x, counts, probs)
    (out * upstream).sum().backward()
    return out.detach(), x.grad, [p.grad for p in params]


@pytest.mark.parametrize("layout", ["shared", "per-expert", "shared-outer"])
def test_adapters_on_te_grouped_linears_add_the_grouped_gemm_paths_terms(layout):
    experts = _adapted(layout)
    assert not experts.grouped_mm  # FP8: transformer-engine's grouped linears
    out, grad_x, grads = _run(experts, grouped_mm=False)
    pad_rows = experts.pad_rows
    assert pad_rows.sum() > 0 and (experts.fc1_output[pad_rows] == 0).all()  # zero rows get no term
    want, want_grad_x, want_grads = _run(experts, grouped_mm=True)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_x, want_grad_x, rtol=1e-6, atol=1e-6)
    assert len(grads) == len(want_grads) == {"shared": 4, "per-expert": 16, "shared-outer": 10}[layout]
    for grad, want_grad in zip(grads, want_grads):
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)
    # only expert 1's own matrices, which see no token, get no gradient
    assert sum(bool(g.abs().sum() == 0) for g in grads) == {"shared": 0, "per-expert": 4, "shared-outer": 2}[layout]
    assert not experts.linear_fc1._forward_hooks and not experts.linear_fc2._forward_hooks  # only during a call
    with torch.no_grad():
        plain, _ = _TEGroupedMLP.forward(experts, *_inputs())  # the base alone
    assert (out - plain).abs().max() > 1e-2 * plain.abs().max()


@pytest.mark.parametrize("layout", ["shared", "per-expert", "shared-outer"])
def test_merging_folds_adapters_of_te_grouped_linears_into_weight0_to_n(layout):
    experts = _adapted(layout)
    adapted, _, _ = _run(experts, grouped_mm=False)
    plain, _, _ = _run(_Experts(), grouped_mm=False)
    assert merge_adapters(experts) == 2 * EXPERTS
    assert type(experts) is _Experts and not any(p.requires_grad for p in experts.parameters())
    with torch.no_grad():
        merged, _ = experts(*_inputs())
    assert (adapted - plain).abs().max() > 1e-2 * plain.abs().max()  # the adapters changed the output
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-6)


def _inputs():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(sum(COUNTS), HIDDEN, generator=generator)
    return x, torch.tensor(COUNTS), torch.rand(sum(COUNTS), generator=generator)
