"""What the model says, through the CLI, on one trained mock-vlm checkpoint: `--eval-samples` answers at each
evaluation without changing the run (bit for bit), `mimo eval --load` with nothing else repeats the run's own last
evaluation (the checkpoint's provider, settings and evaluation options), and `mimo generate` answers a prompt with an
image (text, JSON, TP 2) or a dataset's answer turns (JSON lines), with one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import read_metrics, run_mimo

ENV = {"TORCH_COMPILE_DISABLE": "1"}
# dropout draws random numbers in training: an evaluation that moved an RNG would change every later loss
RUN = ("run", "--provider", "mock-vlm", "--device", "cpu", "--num-workers", "1", "--train-iters", "4",
       "--micro-batch-size", "2", "--eval-iters", "1", "--eval-interval", "2", "--set", "seq_length=96", "--set",
       "dropout=0.1", "--log-interval", "1")


def _mimo(*args: str, ok: bool = True):
    result = run_mimo(*args, env=ENV)
    if ok:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def trained(tmp_path_factory, sample_dataset):
    """A dataset with a val split and two runs on it, with and without --eval-samples; the first saves."""
    tmp = tmp_path_factory.mktemp("generation")
    data = sample_dataset(tmp / "ds")  # `mimo data sample DIR --num-samples 48 --val-shards 1`, run once (conftest.py)
    plain = _mimo(*RUN, "--data", str(data), "--save", str(tmp / "ckpt"), "--metrics-file", str(tmp / "plain.jsonl"))
    sampled = _mimo(*RUN, "--data", str(data), "--eval-samples", "2", "--metrics-file", str(tmp / "sampled.jsonl"),
                    "--tensorboard-dir", str(tmp / "tb"))
    return tmp, data, plain, sampled


def _split(path, train: bool):
    return [r for r in read_metrics(path) if (r["split"] == "train") == train]


def test_eval_samples_are_logged_and_never_change_the_run(trained):
    tmp, _, _, sampled = trained
    assert [r["lm_loss"] for r in _split(tmp / "sampled.jsonl", True)] == \
        [r["lm_loss"] for r in _split(tmp / "plain.jsonl", True)]  # exact equality
    evals = _split(tmp / "sampled.jsonl", False)
    assert [r["lm_loss"] for r in evals] == [r["lm_loss"] for r in _split(tmp / "plain.jsonl", False)]
    assert [r["iteration"] for r in evals] == [2, 4]
    for record in evals:
        assert 0 <= record["exact_match"] <= 1 and 0 <= record["token_f1"] <= 1 and len(record["predictions"]) == 2
        first = record["predictions"][0]
        assert first["reference"] and first["prompt"] == "<image>" and first["answer_tokens"] > 0
        assert set(first) >= {"key", "answer", "prompt_tokens", "stop", "exact_match", "token_f1"}
    assert "predictions (val) at iteration 4 | exact match" in sampled.stdout
    assert "| reference: a " in sampled.stdout  # an excerpt: the question, the reference and the answer

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    assert "predictions validation/text_summary" in events.Tags()["tensors"]
    assert [e.step for e in events.Scalars("token f1 validation")] == [2, 4]


def test_mimo_eval_with_only_the_checkpoint_gives_the_runs_own_last_evaluation(trained):
    tmp, data, _, _ = trained
    result = _mimo("eval", "--load", str(tmp / "ckpt"), "--device", "cpu", "--json", str(tmp / "eval.json"))
    last = _split(tmp / "plain.jsonl", False)[-1]
    figures = json.loads((tmp / "eval.json").read_text())
    assert figures["num_tokens"] == last["num_tokens"] and figures["samples"] == last["samples"]
    assert figures["lm_loss"] == pytest.approx(last["lm_loss"], rel=1e-6, abs=0)
    assert (f"mimo eval: provider mock-vlm, its settings and micro_batch_size=2, global_batch_size=2, data={data}, "
            f"num_workers=1, eval_iters=1 from {tmp / 'ckpt' / 'iter_0000004'}") in result.stdout


def test_mimo_generate_answers_a_prompt_with_an_image(trained, tmp_path):
    from PIL import Image

    tmp = trained[0]
    image = tmp_path / "red.png"
    Image.new("RGB", (40, 30), (200, 10, 10)).save(image)
    args = ("generate", "--load", str(tmp / "ckpt"), "--device", "cpu", "--prompt", "What colour is it?", "--image",
            str(image), "--max-new-tokens", "12")
    text = _mimo(*args)
    assert text.stdout.count("\n") == 1 and text.stdout.strip()  # the answer alone on stdout
    assert all(line.startswith(("mimo generate: provider mock-vlm", "loaded weights from"))
               for line in text.stderr.splitlines()), text.stderr
    one = json.loads(_mimo(*args, "--json").stdout)
    assert one["answer"] == text.stdout[:-1] and one["answer_tokens"] == len(one["tokens"]) <= 12
    assert one["prompt"] == "<image>What colour is it?" and one["stop"] in ("end", "length")
    assert one["prompt_tokens"] > 16 and one["prefill_seconds"] > 0
    tp2 = json.loads(_mimo(*args, "--json", "--nproc-per-node", "2", "--llm-tp", "2", "--encoder-tp", "2").stdout)
    assert tp2["tokens"] == one["tokens"]


def test_mimo_generate_answers_a_datasets_answer_turns(trained, tmp_path):
    tmp, data, _, _ = trained
    out = tmp_path / "answers.jsonl"
    result = _mimo("generate", "--load", str(tmp / "ckpt"), "--device", "cpu", "--data", str(data), "--limit", "3",
                   "--max-new-tokens", "8", "--output", str(out), "--set", "seq_length=128")
    records = read_metrics(out)
    assert len(records) == 3 and all(r["reference"] and r["answer_tokens"] <= 8 for r in records)
    assert len({r["key"] for r in records}) == 3 and result.stdout == ""
    assert f"mimo generate: seq_length=128 (--set; {tmp / 'ckpt' / 'iter_0000004'} has 96)" in result.stderr
    assert f"mimo generate: 3 answers to {data} (val) | exact match 0.000 | token F1 " in result.stderr


@pytest.mark.parametrize("args, message", [
    (("--prompt", "hi", "--image", "nowhere.png"), "--image nowhere.png: no such file"),
    (("--prompt", "hi", "--provider", "nemotron-moe-vlm-tiny"), "was saved by provider 'mock-vlm': drop --provider"),
    (("--prompt", "hi", "--provider-config", "CONFIG"), "sets seq_length=64, but"),
])
def test_mimo_generate_refusals_are_one_line(trained, tmp_path, args, message):
    tmp, data, _, _ = trained
    (tmp_path / "settings.yaml").write_text("seq_length: 64\n")
    args = [str(data) if a == "DATA" else str(tmp_path / "settings.yaml") if a == "CONFIG" else a for a in args]
    result = _mimo("generate", "--load", str(tmp / "ckpt"), "--device", "cpu", *args, ok=False)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_a_dataset_the_checkpoint_names_that_is_gone_is_one_line(trained):
    tmp, data, _, _ = trained
    moved = data.with_name("moved")
    shutil.move(data, moved)
    try:
        result = _mimo("eval", "--load", str(tmp / "ckpt"), "--device", "cpu", ok=False)
    finally:
        shutil.move(moved, data)
    assert result.returncode == 2 and f"was trained with --data {data}, which is not here" in result.stderr


def test_a_provider_without_prompt_format_cannot_generate():
    from types import SimpleNamespace

    from mimo.core.generation.answers import prompt_format_of
    from mimo.errors import UsageError

    with pytest.raises(UsageError, match="provider 'x' cannot generate: it implements no prompt_format hook"):
        prompt_format_of(SimpleNamespace(prompt_format=lambda settings: None), None, "x")


@pytest.mark.parametrize("args, message", [
    (("--eval-iters", "1", "--eval-samples", "2"), "--eval-samples needs --data or --eval-data"),
    (("--eval-iters", "1", "--eval-samples", "2", "--data", "DATA", "--nproc-per-node", "2", "--encoder-ranks", "1"),
     "generation needs every module on every rank"),
])
def test_eval_samples_refusals_are_one_line_before_training(trained, args, message):
    data = trained[1]
    args = [str(data) if a == "DATA" else a for a in args]
    result = _mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--train-iters", "1", *args, ok=False)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert "iteration" not in result.stdout


def test_options_that_cannot_go_together_are_one_line():
    from pathlib import Path

    from mimo.core.config import EvalOptions
    from mimo.core.run.generate import GenerateRequest
    from mimo.errors import UsageError

    with pytest.raises(UsageError, match="--eval-samples needs --eval-iters K"):
        EvalOptions(eval_samples=2).validate()
    with pytest.raises(UsageError, match="needs one of --prompt TEXT"):
        GenerateRequest(prompt="hi").validate(Path("ds"))
    with pytest.raises(UsageError, match="--limit and --output go with --data DIR"):
        GenerateRequest(prompt="hi", limit=2).validate(None)
    with pytest.raises(UsageError, match="--image and --system go with --prompt"):
        GenerateRequest(images=(Path("a.png"),)).validate(Path("ds"))
