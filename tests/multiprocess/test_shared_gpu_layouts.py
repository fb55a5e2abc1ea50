"""Colocated encoders at a TP of their own (core/parallel/shared_ranks.py, core/forward/shared_rank_batches.py)
train to one process's losses and gradient norms (CPU, gloo, fp32): the encoders at TP 1 over both ranks beside an
LLM at TP 2 (fan-in: each rank encodes its share of the lane), and the encoders at TP 2 beside an LLM at DP 2 (fan-out:
one encoder replica feeds both lanes; for the MoE LLM, EP 2). Half the samples carry no image, so a rank's share
often has none while the other's has some."""

import pytest

from helpers import read_metrics, run_mimo

RUN = ("run", "--device", "cpu", "--log-interval", "1", "--seed", "5", "--set", "image_probability=0.5",
       "--micro-batch-size", "2", "--global-batch-size", "8")
KEYS = ("lm_loss", "grad_norm_images", "grad_norm_language")


def train(folder, name, *args):
    metrics = folder / f"{name}.jsonl"
    result = run_mimo(*RUN, *args, "--metrics-file", str(metrics))
    assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
    return read_metrics(metrics), result.stdout


def assert_alike(reference, got, name):
    assert len(got) == len(reference) > 0
    for ref, other in zip(reference, got):
        for key in KEYS:
            assert other[key] == pytest.approx(ref[key], rel=1e-5), (name, ref["iteration"], key)


@pytest.fixture(scope="module")
def mock_single(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mock")
    return folder, train(folder, "single", "--provider", "mock-vlm", "--train-iters", "6")[0]


@pytest.mark.parametrize("name, layout, banner", [
    ("fan-in", ("--llm-tp", "2"), ("images: ranks 0-1 TP1 PP1 DP2", "language: ranks 0-1 TP2 PP1 DP1")),
    ("fan-out", ("--encoder-tp", "2"), ("images: ranks 0-1 TP2 PP1 DP1", "language: ranks 0-1 TP1 PP1 DP2")),
])
def test_mock_vlm_trains_like_one_process(mock_single, name, layout, banner):
    folder, reference = mock_single
    got, stdout = train(folder, name, "--provider", "mock-vlm", "--train-iters", "6", "--nproc-per-node", "2", *layout)
    assert all(module in stdout for module in banner)
    assert_alike(reference, got, name)


def test_nemotron_moe_trains_like_one_process_with_radio_at_tp2_beside_ep2(tmp_path):
    """megatron-core draws each rank's local experts itself: both runs start from one saved checkpoint."""
    nemotron = ("--provider", "nemotron-moe-vlm-tiny")
    assert run_mimo(*RUN, *nemotron, "--train-iters", "1", "--save", str(tmp_path / "start")).returncode == 0
    start = ("--pretrained", str(tmp_path / "start"), "--train-iters", "4")
    reference, _ = train(tmp_path, "single", *nemotron, *start)
    got, stdout = train(tmp_path, "fan-out", *nemotron, *start, "--nproc-per-node", "2", "--encoder-tp", "2",
                        "--llm-ep", "2")
    assert "images: ranks 0-1 TP2 PP1 DP1" in stdout and "language: ranks 0-1 TP1 PP1 DP2 EP2" in stdout
    assert_alike(reference, got, "fan-out")
