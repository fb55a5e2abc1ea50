"""nemotron-moe-vlm-tiny trains through `mimo run` on CPU with dynamic-resolution images (local backend): the
loss falls, and the heterogeneous layout (RADIO on rank 0, the LLM on rank 1) trains exactly like one process."""

from __future__ import annotations

import pytest

from helpers import read_metrics, run_mimo

COMMON = ("run", "--provider", "nemotron-moe-vlm-tiny", "--device", "cpu", "--log-interval", "5", "--seed", "3")
# Two workers on a small machine: one thread each, or they fight over the cores (about 30x slower).
ENV = {"OMP_NUM_THREADS": "1"}


def train(tmp_path, name, *args):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_mimo(*COMMON, "--metrics-file", str(metrics), *args, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(metrics), result


def test_tiny_trains_alike_colocated_and_heterogeneous(tmp_path):
    single, result = train(tmp_path, "single", "--train-iters", "30")
    banner = next(line for line in result.stdout.splitlines() if line.startswith("mimo run:"))
    assert "images: ranks 0-0" in banner and "language: ranks 0-0" in banner
    assert single[-1]["lm_loss"] < 0.9 * single[0]["lm_loss"]  # 30 iterations at the default seq_length 256

    split, result = train(tmp_path, "split", "--train-iters", "30", "--nproc-per-node", "2",
                          "--encoder-ranks", "1")
    banner = next(line for line in result.stdout.splitlines() if line.startswith("mimo run:"))
    assert "images: ranks 0-0" in banner and "language: ranks 1-1" in banner
    assert [r["iteration"] for r in split] == [r["iteration"] for r in single] == [5, 10, 15, 20, 25, 30]
    for ref, got in zip(single, split):
        for key in ("lm_loss", "grad_norm_images", "grad_norm_language"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5), (ref["iteration"], key)


def test_stage1_trains_the_projection_only(tmp_path):
    records, _ = train(tmp_path, "stage1", "--train-iters", "5", "--set", "stage=stage1")
    assert records[-1]["lm_loss"] > 0
    # the frozen LLM has no optimizer (no gradient norm to report); the projection's module trains
    assert not records[-1].get("grad_norm_language") and records[-1]["grad_norm_images"] > 0
    # heterogeneous: the LLM rank holds no trainable parameter at all, and trains (logs) like one process
    split, _ = train(tmp_path, "stage1-split", "--train-iters", "5", "--set", "stage=stage1", "--nproc-per-node", "2",
                     "--encoder-ranks", "1")
    assert [r["lr"] for r in split] == [r["lr"] for r in records]
    assert [r["lm_loss"] for r in split] == pytest.approx([r["lm_loss"] for r in records], rel=1e-5)
