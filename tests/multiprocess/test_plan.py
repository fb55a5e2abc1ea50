"""Layout validation happens before any process group exists; `mimo plan` shows it."""

import json

import pytest

from helpers import run_mimo
from mimo.core.config import LaunchOptions, LayoutOptions, RunConfig, TrainingOptions
from mimo.core.run.plan import prepare
from mimo.errors import UsageError


def plan(world, micro_batch_size=4, settings=(), **layout):
    config = RunConfig(provider="mock-vlm", launch=LaunchOptions(nproc_per_node=world),
                       provider_settings=list(settings), training=TrainingOptions(micro_batch_size=micro_batch_size),
                       layout=LayoutOptions(**layout))
    return prepare(config, world_size=world)


@pytest.mark.parametrize("world, layout, mbs, message", [
    # the world is not tiled by the modules' grids
    (4, {"encoder_ranks": 4}, 4, "--encoder-ranks 4 must leave ranks for the LLM in a world of 4: use 0"),
    (4, {"encoder_ranks": 1, "llm_tp": 2}, 4, "LLM has 3 ranks, not divisible by TP x PP = 2 x 1"),
    # TP must divide the heads (mock-vlm: 4 heads in each model)
    (4, {"encoder_ranks": 1, "llm_tp": 3}, 4, "--llm-tp 3 does not divide the LLM's 4 attention heads: use one of 1, 2, 4"),
    (6, {"encoder_ranks": 3, "encoder_tp": 3}, 4, "--encoder-tp 3 does not divide the encoder 'images''s 4 attention heads"),
    # EP must divide the experts; mock-vlm has none
    (3, {"encoder_ranks": 1, "llm_ep": 2}, 4, "--llm-ep 2 needs a mixture-of-experts LLM"),
    (2, {"llm_expt_tp": 2}, 4, "--llm-expt-tp 2 needs a mixture-of-experts LLM; this provider's LLM has no experts"),
    # encoder DP 2 and LLM DP 3 do not divide one another; fan-in needs the micro-batch to split evenly
    (5, {"encoder_ranks": 2}, 4, "encoder DP 2 and LLM DP 3 must divide one another for the bridge: try --encoder-ranks 1"),
    (4, {"encoder_ranks": 2, "llm_tp": 2}, 3, "--micro-batch-size 3 cannot be split over the 2 encoder ranks"),
    # colocated encoders at a TP of their own: each rank encodes its share of the lane's micro-batch
    (2, {"llm_tp": 2}, 3, "--micro-batch-size 3 cannot be split over the 2 encoder ranks that share each LLM lane"),
    # the LLM's stages beside colocated encoders: the encoders at the LLM's TP, each stage encoding a share
    (4, {"llm_pp": 2, "llm_tp": 2}, 4, "--llm-pp 2 with colocated encoders needs them at the LLM's TP and no CP"),
])
def test_invalid_layouts_are_refused(world, layout, mbs, message):
    with pytest.raises(UsageError) as err:
        plan(world, mbs, **layout)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_tp_must_divide_the_vocabulary():
    # megatron-core's embedding asserts it on every rank once the model is built; mimo plan accepted it
    with pytest.raises(UsageError, match=r"^--llm-tp 2 does not divide the LLM's vocabulary of 261 \(megatron-core "
                                         r"splits the embedding evenly over TP\): pad it to 262, or use --llm-tp "):
        plan(3, settings=["vocab_size=261"], encoder_ranks=1, llm_tp=2)
    plan(3, settings=["vocab_size=262"], encoder_ranks=1, llm_tp=2)


@pytest.mark.parametrize("world, layout, dps", [
    (4, {"encoder_ranks": 1}, {"images": 1, "language": 3}),
    (4, {"encoder_ranks": 2, "encoder_tp": 2}, {"images": 1, "language": 2}),
    (4, {"encoder_ranks": 2, "llm_tp": 2}, {"images": 2, "language": 1}),
    (4, {}, {"images": 4, "language": 4}),
    (2, {"encoder_tp": 2}, {"images": 1, "language": 2}),  # colocated, one encoder replica feeding two lanes
    (2, {"llm_tp": 2}, {"images": 2, "language": 1}),  # colocated, two encoder ranks sharing one lane
    (4, {"llm_pp": 2}, {"images": 4, "language": 2}),  # the LLM's two stages beside the encoders
])
def test_valid_layouts(world, layout, dps):
    assert {n: p.dp for n, p in plan(world, **layout).parallelism.items()} == dps


@pytest.mark.smoke
def test_mimo_plan_command():
    ok = run_mimo("plan", "--provider", "mock-vlm", "--nproc-per-node", "4", "--encoder-ranks", "1", "--json")
    summary = json.loads(ok.stdout)
    assert ok.returncode == 0 and summary["valid"] and summary["llm_data_parallel_lanes"] == 3
    assert [(m["module"], m["ranks"], m["dp"]) for m in summary["modules"]] == [("images", [0, 0], 1),
                                                                                ("language", [1, 3], 3)]
    assert summary["modules"][1]["parameters"] == 133376
    flops = summary["forward_flops_per_sample"]  # the provider's model_flops: which module carries the work
    assert set(flops) == {"images", "language"} and all(v > 0 for v in flops.values())
    bad = run_mimo("plan", "--provider", "mock-vlm", "--nproc-per-node", "4", "--encoder-ranks", "1", "--llm-tp", "3")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
