"""Expert parallelism trains like data parallelism from the same weights (CPU, gloo): colocated EP 2, and EP 2 on
the LLM ranks of a heterogeneous layout.

Initial expert weights depend on the EP size (megatron-core initializes each rank's local experts), so the runs
start from one saved checkpoint (`--pretrained`); from there every layout must give the same losses."""

import pytest

from helpers import read_metrics, run_mimo

COMMON = ("run", "--provider", "nemotron-moe-vlm-tiny", "--device", "cpu", "--log-interval", "1", "--seed", "5",
          "--micro-batch-size", "1", "--num-microbatches", "4", "--set", "image_probability=0.5")
LAYOUTS = {
    "colocated-ep2": ("--nproc-per-node", "2", "--llm-ep", "2"),
    "encoder1-llm2ep2": ("--nproc-per-node", "3", "--encoder-ranks", "1", "--llm-ep", "2"),
}


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    folder = tmp_path_factory.mktemp("experts")
    result = run_mimo(*COMMON, "--train-iters", "1", "--save", str(folder / "start"))
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


def train(folder, name, *layout):
    metrics = folder / f"{name}.jsonl"
    result = run_mimo(*COMMON, *layout, "--train-iters", "4", "--pretrained", str(folder / "start"),
                      "--metrics-file", str(metrics))
    assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
    return read_metrics(metrics)


@pytest.fixture(scope="module")
def reference(start):
    return train(start, "colocated-dp2", "--nproc-per-node", "2")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_losses_match_data_parallel(start, reference, layout):
    other = train(start, layout, *LAYOUTS[layout])
    assert len(other) == len(reference) == 4
    for ref, got in zip(reference, other):
        for key in ("lm_loss", "grad_norm"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5), (layout, ref["iteration"], key)
