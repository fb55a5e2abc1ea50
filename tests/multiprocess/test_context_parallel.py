"""Context parallelism of the LLM trains like one process (CPU, gloo): mock-vlm colocated on 2 ranks with
--llm-cp 2 (one LLM lane, its merged sequence split over both ranks; megatron-core's load-balanced split, RoPE per
CP rank, mimo's SDPAttention gathering keys and values) gives one process's losses and gradient norms.

CP does not shard weights, so both runs start from the same initial weights; half the samples have no image."""

import pytest

from helpers import read_metrics, run_mimo

RUN = ("run", "--provider", "mock-vlm", "--device", "cpu", "--log-interval", "1", "--seed", "5",
       "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--set", "image_probability=0.5")


def train(tmp_path, name, *layout):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_mimo(*RUN, *layout, "--metrics-file", str(metrics))
    assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
    return result, read_metrics(metrics)


def test_cp2_gives_the_losses_and_gradient_norms_of_one_process(tmp_path):
    _, expected = train(tmp_path, "cp1")
    result, got = train(tmp_path, "cp2", "--nproc-per-node", "2", "--llm-cp", "2")
    assert "language: ranks 0-1 TP1 PP1 DP1 CP2" in result.stdout + result.stderr
    assert len(got) == len(expected) == 3
    for ref, other in zip(expected, got):
        for key in ("lm_loss", "grad_norm"):
            assert other[key] == pytest.approx(ref[key], rel=1e-5), (ref["iteration"], key)
