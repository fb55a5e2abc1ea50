"""The per-sample MoE auxiliary loss of a packed micro-batch (plugins/kit/packed_seq_aux_loss.py) over two ranks
(gloo, CPU): under sequence parallelism (TP 2: each rank a consecutive half of the flattened tokens) and context
parallelism (CP 2: transformer-engine's split of each packed sample's place into 4 chunks, rank r keeping chunks r and
3 - r), the ranks' shares of the loss and of the router weight's gradient add up to one process's, as
megatron-core's own loss does over the router's TP x CP group."""

from __future__ import annotations

import json
import os
import socket

import torch

from helpers import start_world

HIDDEN = 16
LENGTHS, PLACES = [5, 11, 2, 7, 13], [0, 8, 20, 24, 32, 48]  # places of multiples of 4 (2 x CP), rows of 16 and 32


def _positions(layout: str, rank: int) -> list[int]:
    """The flattened positions `rank` holds: SP's consecutive halves, or CP's chunks r and 3 - r of each place."""
    if layout == "sp":
        return list(range(rank * PLACES[-1] // 2, (rank + 1) * PLACES[-1] // 2))
    out = []
    for a, b in zip(PLACES[:-1], PLACES[1:]):
        chunks = torch.arange(a, b).chunk(4)
        out += chunks[rank].tolist() + chunks[3 - rank].tolist()
    return out


def _groups(group):
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(tp=group, cp=group, pp=group, dp=group, dp_cp=group, tp_cp=group, tp_dp_cp=group,
                                  ep=group, expt_tp=group, expt_dp=group, tp_ep=group, mp=group)


def _router(group):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mimo.plugins.kit.packed_seq_aux_loss import PerSampleSeqAuxRouter

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, num_moe_experts=8,
                               moe_router_topk=2, moe_router_score_function="sigmoid", moe_router_dtype="fp32",
                               moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2,
                               moe_ffn_hidden_size=HIDDEN, use_cpu_initialization=True)
    torch.manual_seed(0)  # the same weights on every rank
    router = PerSampleSeqAuxRouter(config, pg_collection=_groups(group))
    router.set_layer_number(1)
    return router.train()


def _routed(router, hidden, samples) -> tuple[torch.Tensor, torch.Tensor]:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    tracker.clear()
    router.token_samples = samples
    probs, _ = router(hidden)
    router.token_samples = None
    (probs * 0).sum().backward()  # the gradient left is the auxiliary loss's
    loss = tracker.metrics["seq_load_balancing_loss"].values[0].clone()
    return loss, router.weight.grad.clone()


def _compare(rank: int) -> dict:
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from mimo.plugins.kit.packed_seq_aux_loss import local_token_samples

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    both, alone = dist.new_group([0, 1]), [dist.new_group([r]) for r in range(2)]
    torch.manual_seed(1)
    flat = torch.randn(PLACES[-1], 1, HIDDEN)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    places = torch.tensor(PLACES)
    want_loss, want_grad = _routed(_router(alone[rank]), flat, local_token_samples(cu, places, PLACES[-1]))
    result = {}
    for layout in ("sp", "cp"):
        mine = _positions(layout, rank)
        size = {"cp_size": 2, "cp_rank": rank} if layout == "cp" else {"sp_size": 2, "sp_rank": rank}
        samples = local_token_samples(cu, places, len(mine), **size)
        loss, grad = _routed(_router(both), flat[mine], samples)
        dist.all_reduce(loss, group=both)  # what megatron-core's tracker sums over the router's TP x CP group
        dist.all_reduce(grad, group=both)  # what the gradient reductions of SP and CP add up
        result[layout] = {"loss": [loss.item(), want_loss.item()],
                          "grad": (grad - want_grad).abs().max().item() / want_grad.abs().max().item(),
                          "real_tokens": int((samples.ids < samples.count).sum())}
    dist.destroy_process_group()
    return result


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    from mimo.core.run import cpu_redirect

    cpu_redirect.enable()
    torch.distributed.init_process_group("gloo")
    with open(f"{out}.{rank}", "w") as f:
        json.dump(_compare(rank), f)


def test_ranks_shares_add_up_to_one_processs_loss_and_gradient(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_world(_worker, (port, str(tmp_path / "r")), 2)
    ranks = [json.loads((tmp_path / f"r.{rank}").read_text()) for rank in range(2)]
    for layout in ("sp", "cp"):
        for rank, r in enumerate(ranks):
            got, want = r[layout]["loss"]
            assert want > 0 and abs(got - want) <= 1e-6 * want, (layout, rank, got, want)
            assert r[layout]["grad"] < 1e-5, (layout, rank)
        assert sum(r[layout]["real_tokens"] for r in ranks) == sum(LENGTHS), layout  # each real token once
