"""Context parallelism of the LLM trains like one process (CPU, gloo): mock-vlm colocated on 2 ranks with
--llm-cp 2 (one LLM lane, its merged sequence split over both ranks; megatron-core's load-balanced split, RoPE per
CP rank, mimo's SDPAttention gathering keys and values) gives one process's losses and gradient norms; so does the
LLM's CP 2 on ranks of its own, fed by one or two encoder ranks through the bridge (core/forward/cp_bridge.py), and
a heterogeneous CP 2 checkpoint resumes exactly.

CP does not shard weights, so both runs start from the same initial weights; half the samples have no image."""

import shutil

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


# Two images a sample: their 32 placeholders (of 64 tokens) fall in both CP ranks' chunks, so an encoder gradient
# taken from one CP rank alone (not summed over CP) would change the gradient norms.
TWO_IMAGES = ("--set", "images_per_sample=2")


def test_heterogeneous_cp2_gives_the_losses_and_gradient_norms_of_one_process(tmp_path):
    _, expected = train(tmp_path, "one", *TWO_IMAGES)
    for name, encoder_ranks, world, line in (
            ("one-encoder-rank", "1", "3", "images: ranks 0-0 TP1 PP1 DP1"),
            ("fan-in", "2", "4", "images: ranks 0-1 TP1 PP1 DP2")):  # two encoder ranks feed the one lane
        result, got = train(tmp_path, name, *TWO_IMAGES, "--nproc-per-node", world, "--encoder-ranks", encoder_ranks,
                            "--llm-cp", "2")
        assert line in result.stdout + result.stderr and "TP1 PP1 DP1 CP2" in result.stdout + result.stderr
        assert len(got) == len(expected) == 3
        for ref, other in zip(expected, got):
            for key in ("lm_loss", "grad_norm"):
                assert other[key] == pytest.approx(ref[key], rel=1e-5), (name, ref["iteration"], key)


def test_a_heterogeneous_cp2_checkpoint_resumes_exactly(tmp_path):
    layout = (*TWO_IMAGES, "--nproc-per-node", "3", "--encoder-ranks", "1", "--llm-cp", "2", "--train-iters", "4")
    save, from2 = tmp_path / "save", tmp_path / "from2"
    _, full = train(tmp_path, "full", *layout, "--save", str(save), "--save-interval", "2")
    from2.mkdir()  # the save directory as if the run had stopped after iteration 2
    shutil.copytree(save / "iter_0000002", from2 / "iter_0000002")
    (from2 / "latest_checkpointed_iteration.txt").write_text("2\n")
    result, resumed = train(tmp_path, "resumed", *layout, "--load", str(from2))
    assert "resumed from" in result.stdout
    assert [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in resumed] == \
        [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in full if r["iteration"] > 2]  # exact equality
