"""The qwen3.5-vl providers train through `mimo run` on CPU (local backend): the tiny model's loss falls on the
synthetic captions, and from a Hugging Face Qwen3.5 folder (`--pretrained`) a model split over TP (the gated delta
net's heads split, its output norm's gradient summed over them) or EP trains as the whole one does; a checkpoint
resumes in another layout."""

from __future__ import annotations

import shutil

import pytest

from helpers import read_metrics, run_mimo
from qwen35_models import save_reference

ENV = {"OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1"}


def train(tmp_path, name, provider, *args):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_mimo("run", "--provider", provider, "--device", "cpu", "--seed", "3", "--metrics-file",
                      str(metrics), *args, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(metrics)


def test_tiny_trains_and_its_loss_falls(tmp_path):
    records = train(tmp_path, "tiny", "qwen3.5-vl-tiny", "--train-iters", "20", "--log-interval", "5")
    assert [r["iteration"] for r in records] == [5, 10, 15, 20]
    assert records[-1]["lm_loss"] < 0.9 * records[0]["lm_loss"], [r["lm_loss"] for r in records]


def test_the_initial_weights_do_not_depend_on_the_layout(tmp_path):
    """megatron-core gives a TP rank one block of the gated delta net's q k v z beta alpha rows (not its share of
    each) and draws the convolution per rank: the provider draws them whole and slices, so TP 2 starts where one
    rank does."""
    common = ("--train-iters", "2", "--log-interval", "1")
    one = train(tmp_path, "one", "qwen3.5-vl-tiny", *common)
    two = train(tmp_path, "two", "qwen3.5-vl-tiny", *common, "--nproc-per-node", "2", "--llm-tp", "2",
                "--encoder-tp", "2")
    assert two[0]["lm_loss"] == pytest.approx(one[0]["lm_loss"], rel=1e-6)
    assert two[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=2e-6)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_split_model_trains_as_a_whole_one_from_hugging_face_weights(tmp_path, moe):
    """Dense: TP 2 against one rank. MoE (whose layers need sequence parallelism under TP, which the CPU's torch
    norms lack): the experts split over EP 2 against two data-parallel ranks holding all of them."""
    _, folder = save_reference(tmp_path / "hf", moe)
    provider = "qwen3.5-vl-moe-tiny" if moe else "qwen3.5-vl-tiny"
    common = ("--pretrained", str(folder), "--train-iters", "4", "--log-interval", "1")
    one = train(tmp_path, "whole", provider, *common, *(("--nproc-per-node", "2") if moe else ()))
    split = ("--llm-ep", "2") if moe else ("--llm-tp", "2", "--encoder-tp", "2")
    two = train(tmp_path, "split", provider, *common, "--nproc-per-node", "2", *split)
    assert [r["iteration"] for r in two] == [r["iteration"] for r in one] == [1, 2, 3, 4]
    # the same weights: the same gradient up to the order of sums (a TP rank's unsummed share of the delta net's
    # output-norm gradient moved this norm by 2e-5); then rounding differences grow a little with each update
    assert two[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=2e-6)
    for ref, got in zip(one, two):
        assert got["lm_loss"] == pytest.approx(ref["lm_loss"], rel=1e-5), ref["iteration"]
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), ref["iteration"]


def test_a_checkpoint_resumes_in_another_layout_as_the_run_it_was_saved_in(tmp_path):
    """Saved by one process, resumed with the language model and the tower split over TP 2: the run continues with
    the uninterrupted run's losses. The RNG state, saved per TP rank, has no place in the new grid: it is left out
    with a note (it failed the load before)."""
    common = ("--train-iters", "4", "--log-interval", "1")
    save = tmp_path / "save"
    whole = train(tmp_path, "whole", "qwen3.5-vl-tiny", *common, "--save", str(save), "--save-interval", "2")
    from2 = tmp_path / "from2"
    shutil.copytree(save / "iter_0000002", from2 / "iter_0000002")
    (from2 / "latest_checkpointed_iteration.txt").write_text("2\n")
    metrics = tmp_path / "tp2.jsonl"
    result = run_mimo("run", "--provider", "qwen3.5-vl-tiny", "--device", "cpu", "--seed", "3", *common, "--load",
                      str(from2), "--nproc-per-node", "2", "--llm-tp", "2", "--encoder-tp", "2", "--metrics-file",
                      str(metrics), env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RNG state is per images TP1 x PP1 rank, this run has TP2 x PP1" in result.stdout
    resumed = read_metrics(metrics)
    assert [r["iteration"] for r in resumed] == [3, 4]
    for got in resumed:
        assert got["lm_loss"] == pytest.approx(whole[got["iteration"] - 1]["lm_loss"], rel=1e-5)
