"""The recomputed encoder's forward as CUDA graphs per bucket (plugins/kit/recompute_graphs.py, Nemotron's
`vision_graphs` setting). On the CPU the graphs' padding, buffers and backward run with the forward eager: the
tiny Nemotron's RADIO under full recompute gives megatron-core's recompute outputs and gradients with the images
padded to a bucket; it stays with megatron-core's path in evaluation, without lengths and while an earlier forward
waits for its backward. The provider turns it on only where it applies. (The capture itself needs a GPU: see
docs/benchmarks.md (g).)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import world_of_one
from mimo.plugins.kit.recompute_graphs import RecomputeGraphs, padded_lengths

CPU = torch.device("cpu")


def test_padded_lengths_fill_the_bucket_with_short_sequences():
    assert padded_lengths([5, 9, 3], token_bucket=16, sequence_bucket=4) == [5, 9, 3, 15]
    padded = padded_lengths([5, 9, 3, 4], token_bucket=16, sequence_bucket=4)
    assert padded[:4] == [5, 9, 3, 4] and len(padded) == 8 and sum(padded) == 32 and min(padded[4:]) >= 1
    # an exact fit still gets padding sequences (of one token or more): the bucket's shape stays one
    exact = padded_lengths([8, 8], token_bucket=16, sequence_bucket=2)
    assert exact[:2] == [8, 8] and len(exact) == 4 and sum(exact) == 32 and min(exact) >= 1


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


def _join(**performance):
    from mimo.core.config import PerformanceOptions, RunConfig, TrainingOptions
    from mimo.core.run.plan import prepare
    from mimo.core.run.world import join

    plan = prepare(RunConfig(provider="nemotron-moe-vlm-tiny", training=TrainingOptions(device="cpu",
                                                                                       micro_batch_size=2),
                             performance=PerformanceOptions(**performance)), world_size=1)
    return plan, join(plan)


def _build(recompute: str = "images=full"):
    plan, run = _join(recompute=recompute)
    return plan, run, run.build_model()


def test_the_build_context_says_whether_ddp_overlaps_the_reduction(world):
    """The provider keeps the graphed backward off under --overlap-grad-reduce: the build context must say so."""
    assert _join(overlap_grad_reduce=True)[1].context.overlap_grad_reduce is True
    assert _join()[1].context.overlap_grad_reduce is False


def _radio(model):
    from mimo.providers.nemotron.model import RadioEncoder

    return next(m for m in model.modules() if isinstance(m, RadioEncoder))


def _forward_backward(plan, run, model, batch):
    from mimo.core.forward.batch_transfer import to_device

    model.zero_grad_buffer()
    inputs = to_device({k: v for k, v in batch.items() if k != "modality_inputs"}, CPU, torch.float32)
    modality = to_device(batch["modality_inputs"], CPU, torch.float32)
    output, _ = model(**inputs, modality_inputs=modality or None)
    output.float().pow(2).mean().backward()
    return output.detach(), {n: p.main_grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("backward", [False, True], ids=["eager-backward", "bucket-backward"])
def test_graphed_recompute_gives_megatrons_recompute(world, backward):
    """RADIO's decoder under RecomputeGraphs (small buckets, so the images are padded with extra sequences) gives
    the outputs and every gradient of megatron-core's full recompute of the same weights; with `backward` the
    layers are differentiated over the padded bucket and their gradients added to DDP's buffers by hand."""
    plan, run, graphed = _build()
    _, _, reference = _build()
    radio = _radio(graphed)
    assert radio.decoder.config.recompute_granularity == "full" and radio.recompute_graphs is None  # CPU, local
    runner = radio.recompute_graphs = RecomputeGraphs(radio.decoder, max_seqlen=4096, token_bucket=64,
                                                      sequence_bucket=4, backward=backward)
    calls = []
    eager = runner._eager_forward
    runner._eager_forward = lambda *a, **k: calls.append(1) or eager(*a, **k)

    batch = next(iter(plan.hooks.data_provider(settings=plan.settings, ctx=run.data_context())))
    out_g, grads_g = _forward_backward(plan, run, graphed, batch)
    out_r, grads_r = _forward_backward(plan, run, reference, batch)
    assert not calls and len(runner._buckets) == 1 and runner._in_flight == 0  # the graphed path ran, backward too
    (tokens, sequences, _), = runner._buckets
    bucket, = runner._buckets.values()
    assert (bucket.backward is not None) == backward
    assert tokens % 64 == 0 and sequences % 4 == 0
    torch.testing.assert_close(out_g, out_r, rtol=1e-5, atol=1e-6)
    vision = [n for n in grads_g if ".encoders." in n]
    assert vision and all(grads_g[n].abs().sum() > 0 for n in vision if "decoder.layers" in n)
    for name in grads_r:
        torch.testing.assert_close(grads_g[name], grads_r[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")

    # the same bucket again: no new one; evaluation (no grad) and a call without lengths take megatron's path
    _forward_backward(plan, run, graphed, batch)
    assert len(runner._buckets) == 1 and not calls
    with torch.no_grad():
        _forward_backward_free(graphed, batch)
    assert calls


def _forward_backward_free(model, batch):
    from mimo.core.forward.batch_transfer import to_device

    inputs = to_device({k: v for k, v in batch.items() if k != "modality_inputs"}, CPU, torch.float32)
    model(**inputs, modality_inputs=to_device(batch["modality_inputs"], CPU, torch.float32))


def test_a_second_forward_before_the_backward_takes_megatrons_path(world):
    """The buffers hold one forward's layer inputs: while it waits for its backward, another forward (a pipeline
    schedule's next micro-batch) runs megatron-core's recompute, and both backwards are right."""
    plan, run, model = _build()
    radio = _radio(model)
    runner = radio.recompute_graphs = RecomputeGraphs(radio.decoder, max_seqlen=4096, token_bucket=64)
    eager = []
    original = runner._eager_forward
    runner._eager_forward = lambda *a, **k: eager.append(1) or original(*a, **k)
    hidden = torch.randn(40, 1, radio.decoder.config.hidden_size, requires_grad=True)
    from megatron.core.packed_seq_params import PackedSeqParams

    def call(x):
        cu = torch.tensor([0, 25, 40], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=25,
                                 max_seqlen_kv=25)
        runner.lengths = [25, 15]
        return radio.decoder(x, attention_mask=None, packed_seq_params=params)

    first = call(hidden)
    second = call(hidden)
    assert eager == [1] and runner._in_flight == 1
    first.sum().backward()  # megatron's checkpoints take .backward() only
    grad_first, hidden.grad = hidden.grad, None
    second.sum().backward()
    grad_second = hidden.grad
    assert runner._in_flight == 0
    torch.testing.assert_close(grad_first, grad_second, rtol=1e-5, atol=1e-6)


def test_the_provider_turns_it_on_only_where_it_applies():
    from mimo.providers.nemotron.model import _recompute_graphs
    from mimo.providers.nemotron.settings import NemotronVLMSettings

    def ctx(**changes):
        fields = dict(cuda_graphs=True, recompute={"images": "full"}, parallelism={"images": SimpleNamespace(tp=1)},
                      overlap_grad_reduce=False)
        return SimpleNamespace(**{**fields, **changes})

    s = NemotronVLMSettings()
    options = _recompute_graphs(s, ctx(), "te")
    assert options == {"max_seqlen": 4352, "backward": False}  # 4096 patches + 8 class tokens, rounded up to 256
    every = NemotronVLMSettings(vision_graphs="all")
    assert _recompute_graphs(every, ctx(), "te")["backward"] is True
    assert _recompute_graphs(every, ctx(overlap_grad_reduce=True), "te")["backward"] is False
    assert _recompute_graphs(s, ctx(), "local") is None
    assert _recompute_graphs(s, ctx(cuda_graphs=False), "te") is None
    assert _recompute_graphs(s, ctx(recompute={"images": "selective"}), "te") is None
    assert _recompute_graphs(s, ctx(parallelism={"images": SimpleNamespace(tp=2)}), "te") is None
    assert _recompute_graphs(NemotronVLMSettings(vision_graphs="megatron"), ctx(), "te") is None
    assert _recompute_graphs(NemotronVLMSettings(dropout=0.1), ctx(), "te") is None
