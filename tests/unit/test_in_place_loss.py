"""The language models' fused loss writing the logits' gradient into the logits (plugins/kit/in_place_loss.py).

transformer-engine's kernel runs only on a GPU, so here a CPU function with its contract stands in for it: the
forward keeps the input itself (no copy), the backward writes the gradient into that buffer and bumps its version.
Both built-in language models (megatron-core's GPTModel and HybridModel, as the providers build them) must give the
loss and gradients of megatron-core's own cross-entropy that way: if anything in them kept the logits for its
backward, autograd would refuse the overwritten buffer. The kernel itself is checked on the GPU
(scripts/gpu/slice.sh: first losses and gradient norms equal to main's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import world_of_one
from megatron.core.transformer.spec_utils import build_module
from mimo.core.config import LayoutOptions
from mimo.core.parallel import layout, topology
from mimo.core.run.launch import seed_everything
from mimo.plugins import BuildContext
from mimo.plugins.kit import in_place_loss
from mimo.providers import mock_vlm, nemotron
from mimo.providers.mock_vlm.settings import MockVLMSettings
from mimo.providers.nemotron import TINY, NemotronVLMSettings


class _OverwritingCrossEntropy(torch.autograd.Function):
    """transformer-engine's `overwrite_input=True` contract on the CPU: [s, b, v] logits, per-token fp32 loss."""

    @staticmethod
    def forward(ctx, logits, target, ignore_idx):
        loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="none",
                               ignore_index=ignore_idx).view(target.shape)
        ctx.save_for_backward(logits.detach(), target)
        ctx.ignore_idx = ignore_idx
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target = ctx.saved_tensors
        grad = torch.softmax(logits.float(), dim=-1)
        kept = target != ctx.ignore_idx
        grad.scatter_add_(-1, target.clamp(min=0).unsqueeze(-1), -kept.unsqueeze(-1).to(grad.dtype))
        logits.copy_(grad * (grad_loss * kept).unsqueeze(-1))
        torch.autograd.graph.increment_version(logits)
        return logits, None, None


calls = []


def overwriting_cross_entropy(inp, target, label_smoothing, reduce_loss, group, ignore_idx, *, overwrite_input):
    calls.append((tuple(inp.shape), tuple(target.shape), label_smoothing, reduce_loss, ignore_idx, overwrite_input))
    return _OverwritingCrossEntropy.apply(inp, target, ignore_idx)


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


def _language_model(provider, settings):
    parallelism = layout.plan(LayoutOptions(), 1, provider.model_shape(settings), micro_batch_size=2)
    topo = topology.build(parallelism, backend="gloo")
    seed_everything(0, tp_rank=0, ep_rank=0, etp_rank=0)
    ctx = BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections=topo.pg_collections)
    return build_module(provider.build_language_model(settings, ctx))


def _loss_and_grads(model, fused: bool):
    model.config.cross_entropy_loss_fusion, model.config.cross_entropy_fusion_impl = fused, "te"
    model.zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.vocab_size, (2, 16), generator=generator)
    labels = torch.randint(0, model.vocab_size, (2, 16), generator=generator)
    positions = torch.arange(16).expand(2, 16)
    loss = model(tokens, positions, None, labels=labels)
    (loss * torch.rand(loss.shape, generator=generator)).sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("provider, settings", [
    (mock_vlm, MockVLMSettings(backend="local")),
    (nemotron, NemotronVLMSettings(**{**TINY, "backend": "local"})),
], ids=["GPTModel", "HybridModel"])
def test_the_overwritten_logits_give_megatrons_loss_and_gradients(world, monkeypatch, provider, settings):
    model = _language_model(provider, settings)
    assert isinstance(model, in_place_loss.InPlaceCrossEntropy)
    expected_loss, expected_grads = _loss_and_grads(model, fused=False)  # megatron-core's own cross-entropy
    calls.clear()
    monkeypatch.setattr(in_place_loss, "_in_place_cross_entropy", lambda: overwriting_cross_entropy)
    loss, grads = _loss_and_grads(model, fused=True)
    seq, vocab = 16, model.vocab_size
    assert calls == [((seq, 2, vocab), (seq, 2), 0.0, False, -100, True)]  # [s, b] labels, as the logits
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_megatrons_loss_runs_wherever_the_in_place_kernel_does_not(world, monkeypatch):
    model = _language_model(mock_vlm, MockVLMSettings(backend="local"))
    calls.clear()
    # no transformer-engine here: megatron-core's path, which asks for it under fusion "te"
    assert in_place_loss._in_place_cross_entropy() is None
    with pytest.raises(RuntimeError, match="TE block"):
        _loss_and_grads(model, fused=True)
    monkeypatch.setattr(in_place_loss, "_in_place_cross_entropy", lambda: overwriting_cross_entropy)
    _loss_and_grads(model, fused=False)  # fusion off: megatron-core's vocab-parallel cross-entropy
    model.config.cross_entropy_loss_fusion = True
    logits = torch.randn(2, 4, model.vocab_size).transpose(0, 1)  # [s, b, v], not contiguous: the copying kernel
    with pytest.raises(RuntimeError, match="TE block"):
        model.compute_language_model_loss(torch.zeros(2, 4, dtype=torch.long), logits)
    assert calls == []
