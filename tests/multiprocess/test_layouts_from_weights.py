"""Expert and pipeline parallelism train like data parallelism from the same weights (CPU, gloo): colocated EP 2,
EP 2 on the LLM ranks of a heterogeneous layout, and an LLM in two pipeline stages beside an encoder rank.

Initial weights of these layouts differ from one process's (megatron-core initializes each rank's local experts,
and each pipeline stage builds only its own layers), so the runs start from one saved checkpoint (`--pretrained`);
from there every layout must give the reference's losses and gradient norms."""

import pytest

from helpers import read_metrics, run_mimo

RUN = ("run", "--device", "cpu", "--log-interval", "1", "--seed", "5", "--set", "image_probability=0.5")
PROVIDERS = {  # provider, batch options, reference layout
    "nemotron": (("--provider", "nemotron-moe-vlm-tiny", "--micro-batch-size", "1", "--num-microbatches", "4"),
                 ("--nproc-per-node", "2")),
    "mock": (("--provider", "mock-vlm", "--micro-batch-size", "2", "--global-batch-size", "12"), ()),
}
LAYOUTS = {
    "colocated-ep2": ("nemotron", ("--nproc-per-node", "2", "--llm-ep", "2")),
    "encoder1-llm2ep2": ("nemotron", ("--nproc-per-node", "3", "--encoder-ranks", "1", "--llm-ep", "2")),
    "encoder1-llm2pp": ("mock", ("--nproc-per-node", "3", "--encoder-ranks", "1", "--llm-pp", "2")),
}


def train(folder, provider, name, *layout):
    options, _ = PROVIDERS[provider]
    metrics = folder / f"{name}.jsonl"
    result = run_mimo(*RUN, *options, *layout, "--train-iters", "4", "--pretrained", str(folder / "start"),
                      "--metrics-file", str(metrics))
    assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
    return read_metrics(metrics)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """provider -> (its folder with the start checkpoint, the reference layout's metrics), made when first asked."""
    made = {}

    def get(provider):
        if provider not in made:
            folder = tmp_path_factory.mktemp(provider)
            options, layout = PROVIDERS[provider]
            result = run_mimo(*RUN, *options, "--train-iters", "1", "--save", str(folder / "start"))
            assert result.returncode == 0, result.stderr[-3000:]
            made[provider] = folder, train(folder, provider, "reference", *layout)
        return made[provider]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_match_data_parallel_from_the_same_weights(reference, layout):
    provider, options = LAYOUTS[layout]
    folder, expected = reference(provider)
    got = train(folder, provider, layout, *options)
    assert len(got) == len(expected) == 4
    for ref, other in zip(expected, got):
        for key in ("lm_loss", "grad_norm"):
            assert other[key] == pytest.approx(ref[key], rel=1e-5), (layout, ref["iteration"], key)
