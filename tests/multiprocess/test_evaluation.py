"""Held-out evaluation: it leaves training exactly as it was, reports in every channel, and gives one figure for a
checkpoint whatever the layout (colocated, heterogeneous, LLM PP 2), equal to a plain forward over the samples;
PP 2 trains as one stage does. `mimo eval` on an energon val split: tests/commands/test_evaluation_docs.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import read_metrics, run_mimo, world_of_one
from mimo.errors import UsageError

BASE = ("--provider", "mock-vlm", "--device", "cpu", "--log-interval", "1")
ENV = {"TORCH_COMPILE_DISABLE": "1"}


def run(tmp_path, name, *args, command="run", ok=True):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_mimo(command, *BASE, "--metrics-file", str(metrics), *args, env=ENV)
    if ok:
        assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(metrics) if metrics.exists() else []
    return [r for r in records if r["split"] == "train"], [r for r in records if r["split"] != "train"], result


def by_iteration(records):
    return {r["iteration"]: r["lm_loss"] for r in records}


def test_evaluation_leaves_training_and_resume_exactly_as_they_were(tmp_path):
    # dropout draws random numbers in training: an evaluation that moved the RNG would change every later loss
    common = ("--train-iters", "4", "--set", "dropout=0.1", "--set", "image_probability=0.5")
    plain, none, _ = run(tmp_path, "plain", *common)
    assert none == []
    save = tmp_path / "save"
    board = tmp_path / "tb"
    train, evals, result = run(tmp_path, "eval", *common, "--eval-iters", "2", "--eval-interval", "2",
                               "--eval-at-start", "--save", str(save), "--save-interval", "2",
                               "--tensorboard-dir", str(board))
    assert by_iteration(train) == by_iteration(plain)  # exact equality
    assert [r["iteration"] for r in evals] == [0, 2, 4]  # at start, every 2, and the end only once
    assert all(r["split"] == "val" and r["samples"] == 8 and r["num_tokens"] > 0 for r in evals)
    assert all(math.isclose(r["ppl"], math.exp(r["lm_loss"])) for r in evals)
    assert len({r["lm_loss"] for r in evals}) == 3  # the weights change between evaluations
    lines = [line for line in result.stdout.splitlines() if line.startswith("validation (val) at iteration")]
    assert len(lines) == 3 and "lm loss PPL" in lines[-1] and "samples 8" in lines[-1], result.stdout[-2000:]
    scalars = tensorboard_scalars(board)
    assert [step for step, _ in scalars["lm loss validation"]] == [0, 2, 4]
    assert [v for _, v in scalars["lm loss validation"]] == pytest.approx([r["lm_loss"] for r in evals])
    assert [v for _, v in scalars["lm loss validation ppl"]] == pytest.approx([r["ppl"] for r in evals])

    # resumed from iteration 2 with evaluation on: the same training losses and evaluations as without a stop
    (save / "latest_checkpointed_iteration.txt").write_text("2\n")
    resumed, resumed_evals, _ = run(tmp_path, "resumed", *common, "--eval-iters", "2", "--eval-interval", "2",
                                    "--load", str(save))
    assert by_iteration(resumed) == {i: loss for i, loss in by_iteration(train).items() if i > 2}
    assert by_iteration(resumed_evals) == {4: by_iteration(evals)[4]}


def tensorboard_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A short colocated run that saves at its end and evaluates there: (save dir, its final eval record)."""
    tmp = tmp_path_factory.mktemp("eval-checkpoint")
    save = tmp / "save"
    _, evals, _ = run(tmp, "train", "--train-iters", "3", "--eval-iters", "2", "--save", str(save))
    return save, evals[-1]


HETERO = ("--nproc-per-node", "2", "--encoder-ranks", "1")
PP2 = ("--nproc-per-node", "3", "--encoder-ranks", "1", "--llm-pp", "2")


def test_mimo_eval_of_a_checkpoint_matches_the_run_and_a_plain_forward(tmp_path, checkpoint):
    """Heterogeneous here; colocated in tests/commands/test_evaluation_docs.py, LLM PP 2 below (through mimo run)."""
    save, in_run = checkpoint
    out = tmp_path / "eval.json"
    _, _, result = run(tmp_path, "eval", "--load", str(save), "--eval-iters", "2", "--json", str(out), *HETERO,
                       command="eval")
    figures = json.loads(out.read_text())
    assert figures["iteration"] == 3 and figures["samples"] == 8 and figures["split"] == "val"
    assert "validation (val) at iteration 3 | lm loss" in result.stdout
    assert figures["lm_loss"] == pytest.approx(in_run["lm_loss"], rel=1e-5, abs=0)
    assert figures["lm_loss"] == pytest.approx(plain_forward_loss(save, eval_iters=2), rel=1e-5, abs=0)


def test_llm_pp_2_evaluates_and_trains_like_the_colocated_layout(tmp_path, checkpoint):
    """Each LLM stage builds only its own layers (embedding first, output layer and loss last). From the same
    weights, PP 2's evaluations and training losses are the colocated layout's, and a plain forward's."""
    save, in_run = checkpoint
    start = ("--train-iters", "2", "--pretrained", str(save), "--eval-iters", "2", "--eval-at-start")
    colocated, colocated_evals, _ = run(tmp_path, "colocated", *start)
    piped, piped_evals, result = run(tmp_path, "pp2", *start, *PP2)
    assert "language: ranks 1-2 TP1 PP2 DP1" in result.stdout
    at_start = [colocated_evals[0]["lm_loss"], piped_evals[0]["lm_loss"]]
    assert at_start == pytest.approx([in_run["lm_loss"]] * 2, rel=1e-5, abs=0)
    assert at_start == pytest.approx([plain_forward_loss(save, eval_iters=2)] * 2, rel=1e-5, abs=0)
    assert [r["lm_loss"] for r in piped] == pytest.approx([r["lm_loss"] for r in colocated], rel=1e-5, abs=0)
    assert [r["grad_norm"] for r in piped] == pytest.approx([r["grad_norm"] for r in colocated], rel=1e-4, abs=0)
    assert piped_evals[-1]["lm_loss"] == pytest.approx(colocated_evals[-1]["lm_loss"], rel=1e-5, abs=0)


_plain = {}


def plain_forward_loss(save, eval_iters: int) -> float:
    """The checkpoint's per-token loss over the eval samples, by calling the model directly in one process."""
    if save in _plain:
        return _plain[save]
    from mimo.core.parallel import layout, topology
    from mimo.core.checkpoint.layout import iteration_dir, read_tracker
    from mimo.core.config import LayoutOptions
    from mimo.core.evaluation.evaluator import EVAL_SEED
    from mimo.core.run.launch import seed_everything
    from mimo.core.parallel.model import build_model
    from mimo.plugins import BuildContext, DataContext, Registry
    from mimo.plugins.kit import dist_checkpoint
    from mimo.providers import mock_vlm
    from mimo.providers.mock_vlm import MockVLMSettings
    from mimo.providers.mock_vlm.data import synthetic_batches

    settings = MockVLMSettings()
    with world_of_one():
        parallelism = layout.plan(LayoutOptions(), 1, mock_vlm.model_shape(settings), micro_batch_size=4)
        topo = topology.build(parallelism, backend="gloo")
        seed_everything(0, tp_rank=0, ep_rank=0, etp_rank=0)
        ctx = BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections=topo.pg_collections)
        model = build_model(None, hooks=Registry().hooks("mock-vlm"), settings=settings, provider="mock-vlm",
                            topology=topo, context=ctx, device=torch.device("cpu"), seed=0).eval()
        directory = iteration_dir(save, read_tracker(save))
        loaded, _ = dist_checkpoint.load({"model": model.sharded_state_dict()}, directory)
        model.load_state_dict(loaded["model"])
        batches = synthetic_batches(settings, DataContext(micro_batch_size=4, num_microbatches=1, num_lanes=1,
                                                          seed=EVAL_SEED))
        loss_sum = tokens = 0.0
        with torch.no_grad():
            for _ in range(eval_iters):
                batch = next(batches)
                inputs = {k: v for k, v in batch.items() if k != "modality_inputs"}
                losses, mask = model(**inputs, modality_inputs=batch["modality_inputs"] or None)
                loss_sum += float((losses.double() * mask).sum())
                tokens += float(mask.sum())
    _plain[save] = loss_sum / tokens
    return _plain[save]


@pytest.mark.parametrize("args, message", [
    (("run", "--eval-interval", "2"), "need --eval-iters K"),
    (("run", "--eval-iters", "-1"), "--eval-iters must be 0 or more"),
    (("eval",), "mimo eval needs --load CKPT"),
    (("eval", "--load", "nowhere", "--split", "test"), "--split test needs --data"),
])
def test_bad_evaluation_options_are_one_line(args, message):
    result = run_mimo(*args[:1], *BASE, *args[1:], env=ENV)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_without_weights_or_a_provider_eval_and_generate_ask_for_the_weights():
    from mimo.cli.checkpoint_config import config_from_checkpoint

    for command in ("eval", "generate"):  # they asked for --provider, which would then ask for --load
        with pytest.raises(UsageError, match=f"^mimo {command} needs --load CKPT \\(a mimo checkpoint\\) or "
                                             f"--pretrained PATH"):
            config_from_checkpoint({"provider": None}, None, command)


def test_a_run_files_saving_options_do_not_stop_eval_or_generate():
    # `mimo eval --config ITER/run.yaml --load DIR`: the file's save_interval outlived the save directory dropped
    # for reading weights only, and was refused as "--save-interval needs --save DIR"
    from mimo.core.config import CheckpointOptions, RunConfig
    from mimo.core.run.evaluate import eval_config
    from mimo.core.run.generate import generate_config

    saving = CheckpointOptions(save="runs/a", save_interval=1, keep_last=1, pretrained="runs/a")
    eval_config(RunConfig(provider="mock-vlm", checkpoint=saving), "val").validate()
    generate_config(RunConfig(provider="mock-vlm", checkpoint=saving)).validate()  # (the imports take the time)
