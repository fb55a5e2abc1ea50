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
