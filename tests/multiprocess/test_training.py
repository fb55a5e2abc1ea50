"""mock-vlm trains through `mimo run` on CPU: loss falls, a seed repeats a run, batch and schedule accounting."""

import pytest

from helpers import read_metrics, run_mimo


def train(tmp_path, name, *args):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--metrics-file", str(metrics), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(metrics), result


@pytest.mark.smoke
def test_loss_falls_and_metrics_have_every_field(tmp_path):
    records, result = train(tmp_path, "run", "--train-iters", "30", "--log-interval", "5")
    assert [r["iteration"] for r in records] == [5, 10, 15, 20, 25, 30]
    for key in ("iteration", "lm_loss", "lr", "grad_norm", "consumed_samples", "elapsed_ms", "tokens_per_sec"):
        assert all(r[key] is not None for r in records), key
    assert records[-1]["consumed_samples"] == 30 * 4
    assert records[-1]["lm_loss"] < 0.85 * records[0]["lm_loss"]
    assert "iteration     30/30" in result.stdout and "lm loss" in result.stdout


def test_same_seed_repeats_and_other_seed_differs(tmp_path):
    common = ("--train-iters", "3", "--log-interval", "1")
    first, _ = train(tmp_path, "a", *common, "--seed", "7")
    again, _ = train(tmp_path, "b", *common, "--seed", "7")
    other, _ = train(tmp_path, "c", *common, "--seed", "8")
    assert [r["lm_loss"] for r in first] == [r["lm_loss"] for r in again]
    assert [r["lm_loss"] for r in first] != [r["lm_loss"] for r in other]


def test_train_samples_and_micro_batches(tmp_path):
    records, _ = train(tmp_path, "s", "--train-samples", "20", "--global-batch-size", "8", "--micro-batch-size",
                       "4", "--log-interval", "1")
    assert [r["consumed_samples"] for r in records] == [8, 16]


@pytest.mark.parametrize("style, extra, expected", [
    # init lr 0, warmup 2 iterations, then linear decay to 0 over the run (6 iterations of 4 samples)
    ("linear", ("--lr-warmup-iters", "2"), [0.0, 0.5, 1.0, 0.75, 0.5, 0.25]),
    # WSD: constant, then the last 2 iterations (8 samples) decay linearly
    ("WSD", ("--lr-wsd-decay-iters", "2"), [1.0, 1.0, 1.0, 1.0, 1.0, 0.5]),
    ("constant", ("--lr-warmup-samples", "8"), [0.0, 0.5, 1.0, 1.0, 1.0, 1.0]),
])
def test_learning_rate_schedules(tmp_path, style, extra, expected):
    records, _ = train(tmp_path, style, "--train-iters", "6", "--log-interval", "1", "--lr", "1e-3",
                       "--lr-decay-style", style, *extra)
    assert [round(r["lr"] / 1e-3, 6) for r in records] == expected


@pytest.mark.parametrize("args, message", [
    (("--train-iters", "2", "--train-samples", "8"), "give at most one of --train-iters and --train-samples"),
    (("--global-batch-size", "6"), "--global-batch-size 6 is not a multiple of --micro-batch-size x LLM"),
    (("--lr-decay-style", "WSD"), "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (("--device", "cuda"), "--device cuda: no GPU is visible"),
])
def test_bad_loop_options_are_one_line(args, message):
    result = run_mimo("run", "--provider", "mock-vlm", *args)
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_parameter_counts_match_the_built_model():
    """mock-vlm's analytic counts (used by `model_shape`) equal the parameters megatron-core builds."""
    from mimo.providers.mock_vlm import MockVLMSettings
    from mimo.providers.mock_vlm.model import parameter_counts

    settings = ("projection=affine", "vision_layers=3", "ffn_hidden_size=100")
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--train-iters", "1",
                      *[arg for s in settings for arg in ("--set", s)])
    expected = parameter_counts(MockVLMSettings(projection="affine", vision_layers=3, ffn_hidden_size=100))
    banner = next(line for line in result.stdout.splitlines() if line.startswith("mimo run:"))
    assert f"images: ranks 0-0 TP1 PP1 DP1, {expected['images']:,} params" in banner
    assert f"language: ranks 0-0 TP1 PP1 DP1, {expected['language']:,} params" in banner
