"""docs/evaluation.md's example runs as written: a dataset with a val split, a run that evaluates and saves, and
`mimo eval` of its checkpoint on the same val samples, which gives the run's last evaluation again."""

from __future__ import annotations

import json
import shlex

import pytest

from helpers import REPO, SAMPLE_ARGS, doc_example_lines, read_metrics, run_mimo

DOC = REPO / "docs" / "evaluation.md"
DOC_ROOT = "/tmp/mimo-eval"  # where the example writes; the test writes under its own folder instead


def test_the_documented_example_runs_and_mimo_eval_matches_the_last_in_run_evaluation(tmp_path, sample_dataset):
    lines = doc_example_lines(DOC)
    assert [shlex.split(line)[:2] for line in lines] == [["mimo", "data"], ["mimo", "run"], ["mimo", "eval"]]
    for line in lines:
        argv = shlex.split(line.replace(DOC_ROOT, str(tmp_path)))
        if argv[1:] == ["data", "sample", str(tmp_path / "ds"), *SAMPLE_ARGS]:
            sample_dataset(tmp_path / "ds")  # this very command, run once per test run (conftest.py)
            continue
        result = run_mimo(*argv[1:], env={"TORCH_COMPILE_DISABLE": "1"})
        assert result.returncode == 0, (line, result.stderr[-3000:])
    records = read_metrics(tmp_path / "train.jsonl")
    evals = [r for r in records if r["split"] == "val"]
    assert [r["iteration"] for r in evals] == [3, 6]
    assert evals[-1]["lm_loss"] < evals[0]["lm_loss"]  # six iterations on captions already generalize a little
    figures = json.loads((tmp_path / "eval.json").read_text())
    assert figures["split"] == "val" and figures["iteration"] == 6 and figures["samples"] == evals[-1]["samples"]
    assert figures["num_tokens"] == evals[-1]["num_tokens"]  # the same samples
    assert figures["lm_loss"] == pytest.approx(evals[-1]["lm_loss"], rel=1e-6, abs=0)
    assert "validation (val) at iteration 6 |" in result.stdout


def test_a_dataset_without_a_val_split_is_refused_before_training(tmp_path):
    data = tmp_path / "ds"
    assert run_mimo("data", "sample", str(data), "--num-samples", "16").returncode == 0
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--data", str(data), "--train-iters", "2",
                      "--eval-iters", "1", "--num-workers", "0", env={"TORCH_COMPILE_DISABLE": "1"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"error: --data {data}: the dataset has no val split: hold some samples out" in result.stderr
    assert "iteration      1/2" not in result.stdout
