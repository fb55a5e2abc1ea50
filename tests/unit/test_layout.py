"""The Layout (core/parallel/layout.py), the one owner of the parallel layout: its rules in one check(), the factors
and kinds of rank the other rooms ask it for, its description; and no other room deciding a refusal by reading a
dimension of a module's grid."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mimo.core.config import LayoutOptions
from mimo.core.parallel.layout import Features, Layout, RankGroup
from mimo.errors import UsageError
from mimo.plugins import LANGUAGE, ModuleShape

REPO = Path(__file__).resolve().parents[2]
DENSE = {"images": ModuleShape(num_layers=2, hidden_size=64, num_attention_heads=4),
         LANGUAGE: ModuleShape(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128)}
MOE = {**DENSE, LANGUAGE: ModuleShape(num_layers=4, hidden_size=64, num_attention_heads=4, num_experts=4)}
DIMENSIONS = {"tp", "cp", "pp", "ep", "dp", "expt_tp", "expt_dp"}


def laid_out(world, shapes=DENSE, features=Features(), **options) -> Layout:
    return Layout.plan(LayoutOptions(**options), world, shapes, features).check()


def test_a_colocated_layout_is_one_kind_of_rank_with_the_llm_sequence_split_over_cp():
    layout = laid_out(4, llm_cp=2)
    assert layout.colocated and layout.lanes == 2 and layout.ranks == 4
    assert layout.groups() == [RankGroup("all ranks", (0, 3), ("images", LANGUAGE))]
    # the LLM's lane splits over its CP ranks; the encoders (CP 1) run the lane whole on each of them
    assert (layout.batch_share(LANGUAGE), layout.batch_share("images")) == (4, 2)
    assert (layout.sequence_shards(LANGUAGE), layout.sequence_shards("images")) == (2, 1)
    # the distributed optimizer shards over DP x CP: as many shards as the same ranks as data parallelism
    assert layout.optimizer_shards(LANGUAGE) == layout.replaced(llm_cp=1).optimizer_shards(LANGUAGE) == (4, 4)
    assert layout.replaced(llm_cp=1).lanes == 4
    assert layout.describe() == "images: ranks 0-3 TP1 PP1 DP4 | language: ranks 0-3 TP1 PP1 DP2 CP2"
    assert layout.generation_refusal() is None and layout.one_hardware_queue()


def test_a_split_layout_is_the_encoder_ranks_then_each_llm_stage():
    layout = laid_out(5, encoder_ranks=1, llm_pp=2, llm_tp=2)
    assert not layout.colocated and layout.lanes == 1
    assert layout.groups() == [RankGroup("encoder ranks", (0, 0), ("images",)),
                               RankGroup("LLM stage 0", (1, 2), (LANGUAGE,), 0),
                               RankGroup("LLM stage 1", (3, 4), (LANGUAGE,), 1)]
    assert layout.stages(LANGUAGE) == 2 and layout.weight_shards(LANGUAGE) == (2, 1)
    assert layout.batch_share("images") == 1
    assert layout.generation_refusal() == "generation needs every module on every rank (colocated, --encoder-ranks 0)"
    assert layout.grid_sizes(LANGUAGE) == ([2, 1, 1, 2], [1, 1, 2, 2])


def test_experts_split_over_ep_and_the_sequence_split_is_named_for_the_provider():
    layout = laid_out(4, shapes=MOE, features=Features(sequence_parallel=True), llm_tp=2, encoder_tp=2, llm_ep=2)
    assert layout.weight_shards(LANGUAGE) == (2, 2) and layout.optimizer_shards(LANGUAGE) == (2, 2)
    assert layout.model_shards(LANGUAGE) == 4 and layout.model_shards("images") == 2
    assert layout.sequence_parallel_over(LANGUAGE, True) == 2 and layout.sequence_parallel_over("images", True) == 1
    assert layout.sequence_split() == (2, 1, True)
    assert laid_out(2, shapes=MOE, llm_ep=2).sequence_split() is None


def test_colocated_encoders_at_their_own_tp_read_their_samples_and_exchange_embeddings():
    from mimo.core.parallel.topology import data_positions

    fan_in = laid_out(2, features=Features(micro_batch_size=2), llm_tp=2)  # the encoders at TP 1 over every rank
    assert fan_in.colocated and fan_in.shared_ranks_exchange and fan_in.lanes == 1
    assert fan_in.describe() == "images: ranks 0-1 TP1 PP1 DP2 | language: ranks 0-1 TP2 PP1 DP1"
    assert fan_in.groups() == [RankGroup("all ranks", (0, 1), ("images", LANGUAGE))]
    assert (fan_in.batch_share("images"), fan_in.batch_share(LANGUAGE)) == (2, 1)
    # each rank reads its encoder's share of the lane; the lane's rows are assembled from them
    assert [data_positions(fan_in.parallelism, r, 2) for r in (0, 1)] == [(0, 1), (1, 1)]
    assert fan_in.generation_refusal() == "generation needs the encoders at the LLM's TP (--encoder-tp 2)"
    fan_out = laid_out(2, shapes=MOE, encoder_tp=2, llm_ep=2)  # the LLM's two lanes share one encoder replica
    assert fan_out.shared_ranks_exchange and fan_out.lanes == 2
    assert [data_positions(fan_out.parallelism, r, 2) for r in (0, 1)] == [(0, 4), (0, 4)]
    assert not laid_out(4, llm_tp=2, encoder_tp=2).shared_ranks_exchange
    assert not laid_out(4, llm_cp=2).shared_ranks_exchange  # the CP ranks' encoders read their lane whole


def test_the_llms_stages_beside_colocated_encoders_are_a_kind_of_rank_each_reading_a_share_of_its_lane():
    from mimo.core.parallel.topology import data_positions

    layout = laid_out(4, features=Features(micro_batch_size=2), llm_pp=2)
    assert layout.colocated and layout.stages_beside_encoders and layout.encoders_read_own_samples
    assert not layout.shared_ranks_exchange and layout.lanes == 2
    assert layout.groups() == [RankGroup("LLM stage 0", (0, 1), ("images", LANGUAGE), 0),
                               RankGroup("LLM stage 1", (2, 3), ("images", LANGUAGE), 1)]
    # ranks 0 and 2 hold lane 0's stages and encode its two shares; ranks 1 and 3 lane 1's
    assert [data_positions(layout.parallelism, r, 2) for r in range(4)] == [(0, 1), (2, 1), (1, 1), (3, 1)]
    assert layout.generation_refusal() == "generation needs the LLM in one pipeline stage (--llm-pp 1)"


SIX = {"images": ModuleShape(num_layers=2, hidden_size=64, num_attention_heads=4),
       LANGUAGE: ModuleShape(num_layers=4, hidden_size=60, num_attention_heads=6, vocab_size=120)}


@pytest.mark.parametrize("world, shapes, features, options, message", [
    (2, DENSE, Features(micro_batch_size=1), {"llm_tp": 2},
     "--micro-batch-size 1 cannot be split over the 2 encoder ranks that share each LLM lane: use a multiple of 2"),
    (4, DENSE, Features(), {"encoder_tp": 2, "llm_cp": 2}, "--llm-cp 2 with colocated encoders at their own TP"),
    (2, DENSE, Features(pack_sequences=True), {"encoder_tp": 2}, "--pack-sequences with colocated encoders"),
    (6, SIX, Features(), {"encoder_tp": 2, "llm_tp": 3}, "colocated encoder DP 3 and LLM DP 2 must divide one"),
    (4, DENSE, Features(), {"encoder_tp": 3}, "--encoder-tp 3 does not fit 4 ranks"),
    (4, DENSE, Features(), {"llm_pp": 2, "llm_tp": 2}, "--llm-pp 2 with colocated encoders needs them at the LLM's "
                                                       "TP and no CP: set --encoder-tp 2 and --llm-cp 1"),
    (2, DENSE, Features(micro_batch_size=3), {"llm_pp": 2}, "--micro-batch-size 3 cannot be split over the LLM's 2 "
                                                            "stages"),
])
def test_colocated_encoders_at_their_own_tp_are_refused_where_the_exchange_cannot_work(world, shapes, features,
                                                                                     options, message):
    with pytest.raises(UsageError) as err:
        Layout.plan(LayoutOptions(**options), world, shapes, features).check()
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("world, tp, sp, multiple", [(2, 1, False, 1), (4, 1, False, 4), (4, 2, True, 8),
                                                     (4, 2, False, 4)])
def test_rows_split_over_two_chunks_per_cp_rank_and_tp_under_sequence_parallelism(world, tp, sp, multiple):
    cp = 1 if multiple == 1 else 2
    layout = laid_out(world, features=Features(sequence_parallel=sp), llm_tp=tp, encoder_tp=tp, llm_cp=cp)
    assert layout.shard_multiple == multiple


@pytest.mark.parametrize("world, shapes, features, options, message", [
    (2, DENSE, Features(device="cpu", sequence_parallel=True), {"llm_tp": 2, "encoder_tp": 2},
     "--sequence-parallel needs transformer-engine's norms, which need a GPU"),
    (2, MOE, Features(device="cpu"), {"llm_expt_tp": 2}, "--llm-expt-tp 2 does not run on the CPU"),
    (2, DENSE, Features(cuda_graphs=True), {"llm_cp": 2}, "--llm-cp 2 with --cuda-graphs is not supported yet"),
    (2, DENSE, Features(seq_length=66), {"llm_cp": 2}, "the sequence length 66 must be a multiple of 2 x CP"),
    (3, DENSE, Features(micro_batch_size=1), {"encoder_ranks": 2},
     "--micro-batch-size 1 cannot be split over the 2 encoder ranks that feed each LLM lane: use a multiple of 2"),
    (2, DENSE, Features(), {"encoder_ranks": 2}, "--encoder-ranks 2 must leave ranks for the LLM"),
    # on the CPU the options that need a GPU come after the grid's own rules, before the layout's device rules
    (2, DENSE, Features(device="cpu", gpu_only=("--fp8",)), {"llm_tp": 3}, "--llm-tp 3 does not fit 2 ranks"),
    (2, DENSE, Features(device="cpu", gpu_only=("--fp8",), sequence_parallel=True), {"llm_tp": 2, "encoder_tp": 2},
     "--fp8 needs a GPU; this run is on the CPU"),
])
def test_every_rule_of_a_layout_is_its_checks_one_line(world, shapes, features, options, message):
    layout = Layout.plan(LayoutOptions(**options), world, shapes, features)
    with pytest.raises(UsageError) as err:
        layout.check()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_checkpoints_optimizer_shards_are_compared_module_by_module():
    layout = laid_out(4, encoder_ranks=2)
    assert layout.optimizer_resharding({"images": 2, LANGUAGE: 2}) is None
    assert layout.optimizer_resharding({"images": 2, LANGUAGE: 1}) == (LANGUAGE, 1, 2)


def test_a_checkpoints_rng_state_loads_only_on_the_same_tp_and_pp_sizes():
    saved = {"images": {"tp": 1, "pp": 1}, LANGUAGE: {"tp": 2, "pp": 1}}
    assert laid_out(2, features=Features(micro_batch_size=2), llm_tp=2).rng_resharding(saved) is None
    assert laid_out(2).rng_resharding(saved) == ("the checkpoint's RNG state is per language TP2 x PP1 rank, this run "
                                                 "has TP1 x PP1: its RNG starts from --seed")


def _refusals_reading_a_dimension(path: Path) -> list[str]:
    """`if` statements whose condition reads a grid dimension (`x.tp`, `par.cp`, ...) and whose body raises."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.If):
            continue
        reads = {n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)} & DIMENSIONS
        raises = any(isinstance(n, ast.Raise) for statement in node.body for n in ast.walk(statement))
        if reads and raises:
            found.append(f"{path.relative_to(REPO)}:{node.lineno} reads .{sorted(reads)[0]}")
    return found


def test_no_room_but_the_layout_refuses_a_run_by_reading_a_dimension():
    """A new parallelism's rules go to one place (docs/architecture.md, "A new parallelism"). The contract kit's
    and the providers' checks of their own modules read their BuildContext's parallelism, the public record."""
    owner = REPO / "core" / "parallel" / "layout.py"
    files = [p for room in ("core", "cli") for p in (REPO / room).rglob("*.py") if p != owner]
    assert not [hit for path in files for hit in _refusals_reading_a_dimension(path)]
    assert _refusals_reading_a_dimension(owner)  # the scan sees the rules where they are
