"""The MoE sequence-level auxiliary loss of a packed micro-batch: megatron-core's THD path lays the micro-batch's
rows end to end as one row, and its MoE layers restore the rows from the packing's `tokens_per_sample` (the task
encoder's row length, adapted by the loop to a context-parallel rank's share). Without it the loss balanced the
experts over the whole flattened micro-batch instead of each row, as unpacked rows give it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import build_mimo_model, world_of_one
from mimo.core.parallel.context_parallel import local_rows
from mimo.plugins.data import ConversationTaskEncoder
from test_packing import nemotron_tiny, samples

SEQ_AUX = "seq_load_balancing_loss"


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


def _seq_aux_losses(model, batch) -> torch.Tensor:
    """Each MoE layer's sequence-level auxiliary loss (megatron-core's tracker) for one training forward."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    clear_aux_losses_tracker()
    inputs = {k: v for k, v in batch.items() if k != "modality_inputs"}
    model(**inputs, modality_inputs=batch["modality_inputs"] or None)
    values = get_moe_layer_wise_logging_tracker()[SEQ_AUX]["values"].clone()
    clear_aux_losses_tracker()
    return values[values != 0]


def test_a_packed_micro_batch_balances_each_row_like_unpacked_rows(world):
    module, settings, modality, encoder_args = nemotron_tiny()
    assert settings.moe_aux_loss_coeff > 0 and "E" in settings.hybrid_pattern
    model = build_mimo_model(module, settings, modality).train()
    packed = ConversationTaskEncoder(**encoder_args, pack_sequences=True)
    encoded = [packed.encode_sample(s) for s in samples()]
    rows = [packed.pack_selected_samples(g) for g in packed.select_samples_to_pack(encoded)]
    assert len(rows) >= 2 and any(len(r.seqlens) > 1 for r in rows), "the test needs several packed rows"
    batch = packed.batch(rows)
    assert batch["packing_kwargs"]["tokens_per_sample"] == settings.seq_length

    # each row alone (a micro-batch of one row: nothing to restore) gives that row's loss; megatron-core's loss
    # of several rows is their mean, as for unpacked rows
    alone = torch.stack([_seq_aux_losses(model, packed.batch([row])) for row in rows])
    together = _seq_aux_losses(model, batch)
    assert together.numel() == settings.hybrid_pattern.count("E")
    torch.testing.assert_close(together, alone.mean(0), rtol=1e-5, atol=1e-9)

    # what the loss was without the row length: balanced over the whole flattened micro-batch
    flat = dict(batch, packing_kwargs={**batch["packing_kwargs"], "tokens_per_sample": None})
    assert not torch.allclose(_seq_aux_losses(model, flat), alone.mean(0), rtol=1e-3)


def _partitioned(cp: int = 1, tp: int = 1, seq_parallel: bool = False):
    size = lambda n: SimpleNamespace(size=lambda: n)  # noqa: E731
    cfg = SimpleNamespace(use_cp=cp > 1, cp_group=size(cp), seq_parallel=seq_parallel, tp_group=size(tp))
    return SimpleNamespace(partition_adapter=SimpleNamespace(cfg=cfg))


def test_the_row_length_is_a_ranks_share_of_the_row():
    """A CP rank holds 1/CP of every row; sequence parallelism over TP > 1 cuts the flattened rows anywhere, so
    no row length fits and megatron-core's MoE layers are left the flattened micro-batch."""
    kwargs = {"cu_seqlens_q": torch.tensor([0, 5, 16]), "tokens_per_sample": 16}
    assert local_rows(SimpleNamespace(), kwargs) is kwargs  # no partition adapter: CP 1, no SP
    assert local_rows(_partitioned(cp=2), kwargs)["tokens_per_sample"] == 8
    assert local_rows(_partitioned(cp=2, tp=2, seq_parallel=True), kwargs)["tokens_per_sample"] is None
    assert local_rows(_partitioned(tp=1, seq_parallel=True), kwargs)["tokens_per_sample"] == 16
    assert kwargs["tokens_per_sample"] == 16  # the batch's own dict is left alone
    assert local_rows(_partitioned(cp=2), None) is None
