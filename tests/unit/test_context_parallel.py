"""--llm-cp: the option, the plan's refusals (one line each, before any process group), the grids it lays out,
the memory plan per CP rank, and which ranks' loss totals add up to a lane's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from mimo.core.config import DataOptions, LaunchOptions, LayoutOptions, PerformanceOptions, RunConfig, TrainingOptions
from mimo.core.memory import estimate as memory
from mimo.core.memory import fit
from mimo.core.parallel.topology import counted_once
from mimo.core.run.plan import prepare
from mimo.errors import UsageError


def plan(world, provider="mock-vlm", settings=(), performance=None, data=None, precision="fp32", **layout):
    config = RunConfig(provider=provider, provider_settings=list(settings),
                       launch=LaunchOptions(nproc_per_node=world),
                       training=TrainingOptions(micro_batch_size=2, precision=precision),
                       layout=LayoutOptions(**layout), performance=performance or PerformanceOptions(),
                       data=data or DataOptions())
    return prepare(config, world_size=world)


def test_llm_cp_below_one_is_refused_by_the_options():
    with pytest.raises(UsageError, match="--llm-cp must be at least 1, got 0"):
        LayoutOptions(llm_cp=0).validate()


@pytest.mark.parametrize("world, kwargs, message", [
    (4, {"encoder_ranks": 1, "llm_cp": 2}, "LLM has 3 ranks, not divisible by TP x CP x PP = 1 x 2 x 1: choose "
                                           "--llm-cp among 1, 3"),
    (3, {"llm_cp": 2}, "LLM has 3 ranks, not divisible by TP x CP x PP = 1 x 2 x 1: choose --llm-cp among 1, 3"),
    (2, {"llm_cp": 2, "settings": ["seq_length=66"]},
     "the sequence length 66 must be a multiple of 2 x CP = 2 x 2 = 4 (the load-balanced split); use --set "
     "seq_length=68"),
    (4, {"llm_cp": 2, "llm_tp": 2, "encoder_tp": 2, "settings": ["seq_length=68"],
         "performance": PerformanceOptions(sequence_parallel=True)},
     "must be a multiple of 2 x CP x TP = 2 x 2 x 2 = 8"),
    # packed rows: transformer-engine splits them over CP (GPUs); the CPU's backends cannot
    (2, {"llm_cp": 2, "data": DataOptions(data=Path(__file__).parent, pack_sequences=True)},
     "--llm-cp 2 with --pack-sequences needs transformer-engine on GPUs (its split of packed rows; the CPU's "
     "backends have none): run on GPUs with mimo[te] installed, or without --pack-sequences"),
    (2, {"llm_cp": 2, "performance": PerformanceOptions(cuda_graphs=True), "precision": "bf16"},
     "--llm-cp 2 with --cuda-graphs is not supported yet"),
    # the provider's refusal, at plan time: Nemotron's Mamba layers split over CP on mamba-ssm's kernels only
    (2, {"llm_cp": 2, "provider": "nemotron-moe-vlm-tiny"}, "--llm-cp 2 needs backend te: the Mamba layers'"),
])
def test_layouts_that_cannot_split_the_sequence_are_refused_in_one_line(world, kwargs, message):
    with pytest.raises(UsageError) as err:
        plan(world, **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_packed_rows_split_over_cp_where_transformer_engine_can():
    """CP with packing: refused on the CPU, accepted in a plan for GPUs (made here, on a host without one, whose
    workers check for transformer-engine again at their first micro-batch)."""
    from mimo.core.parallel.layout import splits_packed_rows

    if torch.cuda.is_available():
        pytest.skip("checks a host without a GPU")
    assert not splits_packed_rows("cpu") and not splits_packed_rows("auto") and splits_packed_rows("cuda")
    config = RunConfig(provider="mock-vlm", launch=LaunchOptions(nproc_per_node=2),
                       training=TrainingOptions(micro_batch_size=2, device="cuda", precision="bf16"),
                       layout=LayoutOptions(llm_cp=2),
                       data=DataOptions(data=Path(__file__).parent, pack_sequences=True))
    assert prepare(config, world_size=2).parallelism["language"].cp == 2


def test_the_data_learns_its_segments_multiple_from_the_layout():
    """The loop tells the data the multiple packed samples' padded lengths must be for the LLM's CP split."""
    from mimo.core.run.world import World

    gpu = prepare(RunConfig(provider="mock-vlm", provider_settings=["seq_length=64"],
                            launch=LaunchOptions(nproc_per_node=4),
                            training=TrainingOptions(device="cuda", precision="bf16", micro_batch_size=2),
                            layout=LayoutOptions(llm_cp=2, llm_tp=2, encoder_tp=2),
                            performance=PerformanceOptions(sequence_parallel=True)), world_size=4)
    world = World(gpu, torch.device("cpu"), topology=None, context=None, seed=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.distributed, "get_rank", lambda: 3)
        assert world.data_context().segment_multiple == 8  # 2 x CP x TP under sequence parallelism


def test_colocated_cp_splits_the_llm_ranks_and_keeps_the_encoders_at_cp_1():
    p = plan(4, llm_cp=2)
    llm, images = p.parallelism["language"], p.parallelism["images"]
    assert (llm.cp, llm.dp, images.cp, images.dp) == (2, 2, 1, 4)
    assert p.num_lanes == 2 and p.global_batch_size == 4  # two lanes of micro-batch 2


def test_heterogeneous_cp_splits_the_llm_ranks_and_feeds_each_lane_from_the_encoder_ranks():
    p = plan(5, encoder_ranks=1, llm_cp=2)  # fan-out: one encoder rank feeds 2 lanes of 2 CP ranks each
    llm, images = p.parallelism["language"], p.parallelism["images"]
    assert (llm.first_rank, llm.cp, llm.dp, images.cp, images.dp) == (1, 2, 2, 1, 1)
    assert p.num_lanes == 2
    fan_in = plan(4, encoder_ranks=2, llm_cp=2).parallelism  # 2 encoder ranks feed one lane of 2 CP ranks
    assert (fan_in["images"].dp, fan_in["language"].dp, fan_in["language"].cp) == (2, 1, 2)


def test_the_bridge_sees_the_same_rank_blocks_with_cp_folded_into_tp(monkeypatch):
    from megatron.core.hyper_comm_grid import HyperCommGrid

    from mimo.core.forward.cp_bridge import cp_folded_into_tp

    monkeypatch.setenv("WORLD_SIZE", "17")
    grid = HyperCommGrid([2, 2, 2, 2], ["tp", "cp", "dp", "pp"], rank_offset=1)
    folded = cp_folded_into_tp(grid)
    assert folded.shape == [4, 1, 2, 2] and (folded.rank_offset, folded.size) == (1, 16)
    # what megatron-core's bridge enumerates: each stage's TP x CP block (a broadcast group: order within it does
    # not matter) and each lane's ranks, whose first is the destination's leader
    for dims in (["tp", "cp"], ["tp", "cp", "pp"]):
        assert [sorted(g) for g in folded._gen_rank_enum(dims)] == [sorted(g) for g in grid._gen_rank_enum(dims)]
        assert [g[0] for g in folded._gen_rank_enum(dims)] == [g[0] for g in grid._gen_rank_enum(dims)]
    cp1 = HyperCommGrid([2, 1, 2, 1], ["tp", "cp", "dp", "pp"])
    assert cp_folded_into_tp(cp1) is cp1


def _language_terms(p, distributed_optimizer=False):
    options = dataclasses.replace(memory.options_of(p), distributed_optimizer=distributed_optimizer)
    rows = fit.encoder_rows(p.parallelism, p.config.training.micro_batch_size)
    (rank,) = memory.estimate(p.hooks.module_memory(settings=p.settings), p.parallelism, options, rows)
    return {m.module: m for m in rank.modules}


def test_the_memory_plan_counts_llm_activations_per_cp_rank():
    whole, split = _language_terms(plan(2)), _language_terms(plan(2, llm_cp=2))
    assert split["language"].tokens == whole["language"].tokens / 2
    assert split["language"].activations == pytest.approx(whole["language"].activations / 2)
    # the encoders see the whole lane on each rank, and the weights are not split by CP
    assert split["images"].activations == pytest.approx(whole["images"].activations)
    assert split["language"].parameters == whole["language"].parameters
    # the distributed optimizer shards over data x context parallelism: DP 2 and CP 2 shard alike
    sharded_dp, sharded_cp = _language_terms(plan(2), True), _language_terms(plan(2, llm_cp=2), True)
    assert sharded_cp["language"].optimizer == pytest.approx(sharded_dp["language"].optimizer)


def test_loss_totals_come_from_every_cp_rank_and_data_counts_from_one():
    totals = torch.tensor([6.0, 3.0, 1.0, 2.0], dtype=torch.float64)
    assert counted_once(totals, True, True).tolist() == [6.0, 3.0, 1.0, 2.0]  # CP rank 0: everything
    assert counted_once(totals, True, False).tolist() == [6.0, 3.0, 0.0, 0.0]  # other CP ranks: their loss part
    assert counted_once(totals, False, False).tolist() == [0.0] * 4  # not the last stage's first TP rank
