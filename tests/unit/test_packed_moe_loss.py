"""The MoE sequence-level auxiliary loss of a packed micro-batch (plugins/kit/packed_seq_aux_loss.py): megatron-core's
THD path lays the micro-batch's rows end to end as one row; the kit's MoE layer reads each token's packed sample from
the packing's boundaries and its router balances each sample on its own, padding left out. The loss (and the
router's gradient from it) is then the mean of what megatron-core gives each sample run alone, one sample a row."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import build_mimo_model, world_of_one
from mimo.core.parallel.context_parallel import local_rows
from mimo.plugins.data import ConversationTaskEncoder
from mimo.plugins.kit.packed_seq_aux_loss import PerSampleSeqAuxRouter, local_token_samples
from test_packing import nemotron_tiny, samples

SEQ_AUX = "seq_load_balancing_loss"
HIDDEN = 16


@pytest.fixture(scope="module")
def groups():
    """A world of one (gloo) and its process groups."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    with world_of_one():
        g = dist.new_group([0])
        yield ProcessGroupCollection(tp=g, cp=g, pp=g, dp=g, dp_cp=g, tp_cp=g, tp_dp_cp=g, ep=g, expt_tp=g,
                                     expt_dp=g, tp_ep=g, mp=g)


@pytest.fixture(autouse=True)
def fresh_tracker():
    """megatron-core's MoE tracker sizes its entries by the first model's layers: a new one for each test."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()
    yield
    destroy_moe_metrics_tracker()


def seq_aux_losses() -> torch.Tensor:
    """Each MoE layer's logged sequence-level auxiliary loss since the last call (megatron-core's tracker)."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    values = tracker.metrics[SEQ_AUX].values.clone()
    tracker.clear()
    return values


def routers(pg_collection, per_token_loss: bool):
    """megatron-core's TopKRouter and the kit's, with the same weights (Nemotron's routing: sigmoid, top 2)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, num_moe_experts=8,
                               moe_router_topk=2, moe_router_score_function="sigmoid", moe_router_dtype="fp32",
                               moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2,
                               moe_ffn_hidden_size=HIDDEN, calculate_per_token_loss=per_token_loss,
                               use_cpu_initialization=True)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    torch.manual_seed(0)
    megatron, kit = TopKRouter(config, pg_collection=pg_collection), PerSampleSeqAuxRouter(config,
                                                                                          pg_collection=pg_collection)
    kit.load_state_dict(megatron.state_dict())
    for router in (megatron, kit):
        router.set_layer_number(1)
        router.train()
    return megatron, kit


def routed(router, hidden, samples=None) -> tuple[float, torch.Tensor]:
    """(the logged loss, the router weight's gradient from the auxiliary loss alone) of one forward."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    get_moe_metrics_tracker().clear()
    router.zero_grad()
    router.token_samples = samples
    probs, _ = router(hidden)
    router.token_samples = None
    (probs * 0).sum().backward()  # the routing's own gradient is zero: what is left comes from the loss
    return seq_aux_losses()[0].item(), router.weight.grad.clone()


def packed(pieces: list[list[int]], lengths: list[int], row: int, hidden: list[torch.Tensor]):
    """The samples laid out as the task encoder packs them: rows of `row` tokens, samples back to back, each row's
    padding (random hidden states) the tail of its last sample; an empty row is one sample of 0 tokens."""
    tokens, cu, places = [], [0], [0]
    for group in pieces:
        used = sum(lengths[i] for i in group)
        for j, i in enumerate(group):
            tokens.append(hidden[i])
            cu.append(cu[-1] + lengths[i])
            places.append(places[-1] + (lengths[i] if j < len(group) - 1 else row - used + lengths[i]))
        if not group:
            cu.append(cu[-1])
            places.append(places[-1] + row)
        tokens.append(torch.randn(row - used, 1, HIDDEN))
    return torch.cat(tokens), torch.tensor(cu, dtype=torch.int32), torch.tensor(places, dtype=torch.int32)


def test_samples_of_one_length_give_megatrons_loss_of_unpacked_rows(groups):
    """Five samples of 6 tokens: megatron-core's loss of `[6, 5]` rows, and its gradient under per-token loss
    scaling (the valid tokens are the real ones), from three packed rows of 16 with their padding."""
    megatron, kit = routers(groups, per_token_loss=True)
    hidden = [torch.randn(6, 1, HIDDEN) for _ in range(5)]
    want = routed(megatron, torch.cat(hidden, dim=1))
    flat, cu, places = packed([[0, 1], [2, 3], [4]], [6] * 5, 16, hidden)
    got = routed(kit, flat, local_token_samples(cu, places, flat.shape[0]))
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-9)


def test_samples_of_different_lengths_give_the_mean_of_each_alone(groups):
    """Samples of 1 to 12 tokens, packed into rows of 16 with an empty row among them: the mean over samples of
    megatron-core's loss of each sample alone, and of its gradient; not the rows' loss megatron-core restores."""
    megatron, kit = routers(groups, per_token_loss=False)
    lengths = [3, 9, 5, 12, 1, 7]
    hidden = [torch.randn(n, 1, HIDDEN) for n in lengths]
    alone = [routed(megatron, h) for h in hidden]
    flat, cu, places = packed([[0, 1], [2, 4, 5], [], [3]], lengths, 16, hidden)
    samples = local_token_samples(cu, places, flat.shape[0])
    assert samples.count == 7 and int((samples.ids < 7).sum()) == sum(lengths)
    loss, grad = routed(kit, flat, samples)
    assert loss == pytest.approx(sum(a[0] for a in alone) / len(alone), rel=1e-6)
    torch.testing.assert_close(grad, sum(a[1] for a in alone) / len(alone), rtol=1e-5, atol=1e-9)
    rows_loss, _ = routed(megatron, flat.view(4, 16, HIDDEN).transpose(0, 1).contiguous())  # megatron-core's restored rows
    assert rows_loss != pytest.approx(loss, rel=1e-2)


def test_without_samples_the_router_is_megatrons(groups):
    """Unpacked rows (no samples handed over): megatron-core's loss and gradient, bit for bit."""
    megatron, kit = routers(groups, per_token_loss=True)
    hidden = torch.randn(10, 3, HIDDEN)
    want, got = routed(megatron, hidden), routed(kit, hidden)
    assert got[0] == want[0] and torch.equal(got[1], want[1])


def _shares(places: list[int], cp: int, sp: int) -> list[list[int]]:
    """Reference: each (CP rank, SP rank)'s flattened positions, by cutting each place into 2 x CP chunks."""
    out = []
    for r in range(cp):
        stream = []
        for a, b in zip(places[:-1], places[1:]):
            chunks = torch.arange(a, b).chunk(2 * cp)
            stream += chunks[r].tolist() + chunks[2 * cp - 1 - r].tolist()
        share = len(stream) // sp
        out += [stream[s * share:(s + 1) * share] for s in range(sp)]
    return out


@pytest.mark.parametrize("cp,sp", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_each_rank_finds_the_samples_of_its_tokens(cp, sp):
    """Under context parallelism (transformer-engine's split of each place) and sequence parallelism (consecutive
    shares of a CP rank's tokens): every token's sample, padding marked, on the rank that holds it."""
    lengths, places = [5, 0, 11, 6, 3], [0, 8, 24, 40, 48, 64]  # the second: an empty row's one sequence
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    truth = torch.full((64,), 5)
    for i, (a, n) in enumerate(zip(places, lengths)):
        truth[a:a + n] = i
    positions = _shares(places, cp, sp)
    for rank, mine in enumerate(positions):
        got = local_token_samples(cu, torch.tensor(places), len(mine), cp_size=cp, cp_rank=rank // sp,
                                  sp_size=sp, sp_rank=rank % sp)
        assert got.count == 5 and got.ids.tolist() == truth[mine].tolist(), (cp, sp, rank)


# ------------------------------------------------------------------------------ the Nemotron model end to end


@pytest.fixture(scope="module")
def world(groups):
    yield


def _forward_backward(model, batch) -> torch.Tensor:
    """One training forward; backward of the auxiliary losses alone. Each MoE layer's logged loss."""
    inputs = {k: v for k, v in batch.items() if k != "modality_inputs"}
    loss, _ = model(**inputs, modality_inputs=batch["modality_inputs"] or None)
    (loss * 0).sum().backward()
    return seq_aux_losses()


def _router_grads(model) -> torch.Tensor:
    grads = [p.grad.clone() for name, p in model.named_parameters() if name.endswith("router.weight")]
    model.zero_grad()
    return torch.stack(grads)


def test_a_packed_micro_batch_balances_each_sample_as_if_alone(world):
    """nemotron-moe-vlm-tiny (local backend, fp32), the task encoder's packed rows: each MoE layer's loss is the mean
    of each sample's alone (an unpacked row of exactly its tokens), and the routers' gradients from the losses too
    (per-token loss scaling: a micro-batch's loss weighs by its real tokens, so the gradients per real token)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    module, settings, modality, encoder_args = nemotron_tiny()
    assert settings.moe_aux_loss_coeff > 0 and "E" in settings.hybrid_pattern
    model = build_mimo_model(module, settings, modality).train()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    unpacked = ConversationTaskEncoder(**encoder_args)
    encoder = ConversationTaskEncoder(**encoder_args, pack_sequences=True)
    encoded = [encoder.encode_sample(s) for s in samples()]
    rows = [encoder.pack_selected_samples(g) for g in encoder.select_samples_to_pack(encoded)]
    assert len(rows) >= 2 and any(len(r.seqlens) > 1 for r in rows), "the test needs several packed rows"
    batch = encoder.batch(rows)

    alone, grads, tokens = [], [], []
    for sample in encoded:
        one = unpacked.batch([sample])
        n = len(sample.tokens)
        one = {k: (v[..., :n] if k != "modality_inputs" else v) for k, v in one.items()}
        alone.append(_forward_backward(model, one))
        grads.append(_router_grads(model) / n)
        tokens.append(n)
    assert torch.stack(grads).abs().amax(dim=(1, 2, 3)).min() > 0  # every sample moves every router
    together = _forward_backward(model, batch)
    moe_layers = settings.hybrid_pattern.count("E")
    assert int((together != 0).sum()) == moe_layers
    torch.testing.assert_close(together, torch.stack(alone).mean(0), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(_router_grads(model) / sum(tokens), torch.stack(grads).mean(0), rtol=1e-4,
                               atol=1e-10)


def _partitioned(cp: int = 1, tp: int = 1, seq_parallel: bool = False):
    size = lambda n: SimpleNamespace(size=lambda: n)  # noqa: E731
    cfg = SimpleNamespace(use_cp=cp > 1, cp_group=size(cp), seq_parallel=seq_parallel, tp_group=size(tp))
    return SimpleNamespace(partition_adapter=SimpleNamespace(cfg=cfg))


def test_the_row_length_is_a_ranks_share_of_the_row():
    """megatron-core's own fallback for MoE layers without the kit's (its rows restored from `tokens_per_sample`):
    a CP rank holds 1/CP of every row; sequence parallelism over TP > 1 cuts the flattened rows anywhere, so no row
    length fits and megatron-core's MoE layers are left the flattened micro-batch."""
    kwargs = {"cu_seqlens_q": torch.tensor([0, 5, 16]), "tokens_per_sample": 16}
    assert local_rows(SimpleNamespace(), kwargs) is kwargs  # no partition adapter: CP 1, no SP
    assert local_rows(_partitioned(cp=2), kwargs)["tokens_per_sample"] == 8
    assert local_rows(_partitioned(cp=2, tp=2, seq_parallel=True), kwargs)["tokens_per_sample"] is None
    assert local_rows(_partitioned(tp=1, seq_parallel=True), kwargs)["tokens_per_sample"] == 16
    assert kwargs["tokens_per_sample"] == 16  # the batch's own dict is left alone
    assert local_rows(_partitioned(cp=2), None) is None
