"""Separate layouts on shared ranks train to one process's losses and gradient norms (CPU, gloo, fp32):

- colocated encoders at a TP of their own (core/parallel/shared_ranks.py, core/forward/shared_rank_batches.py):
  the encoders at TP 1 over both ranks beside an LLM at TP 2 (fan-in: each rank encodes its share of the lane),
  and at TP 2 beside an LLM at DP 2 (fan-out: one encoder replica feeds both lanes; the MoE LLM at EP 2);
- the LLM in two pipeline stages while the encoders run on every rank (core/forward/encoders_beside_stages.py),
  held-out evaluation included.

Half the samples carry no image, so a rank's share often has none while another's has some. megatron-core draws
a pipeline stage's or an expert-parallel rank's weights itself: every run starts from one saved checkpoint."""

import pytest

from helpers import read_metrics, run_mimo

RUN = ("run", "--device", "cpu", "--log-interval", "1", "--seed", "5", "--set", "image_probability=0.5",
       "--micro-batch-size", "2", "--global-batch-size", "8")
PROVIDERS = {  # the tiny Nemotron in four layers: two pipeline stages
    "mock": ("--provider", "mock-vlm"),
    "nemotron": ("--provider", "nemotron-moe-vlm-tiny", "--set", "hybrid_pattern=M*EE"),
}
TRAIN = ("--train-iters", "4", "--eval-iters", "1", "--eval-interval", "2")
KEYS = ("lm_loss", "grad_norm_images", "grad_norm_language")
LAYOUTS = {
    "mock-fan-in": ("mock", ("--llm-tp", "2"), ("images: ranks 0-1 TP1 PP1 DP2", "language: ranks 0-1 TP2 PP1 DP1")),
    "mock-fan-out": ("mock", ("--encoder-tp", "2"),
                     ("images: ranks 0-1 TP2 PP1 DP1", "language: ranks 0-1 TP1 PP1 DP2")),
    "mock-pp2": ("mock", ("--llm-pp", "2"), ("images: ranks 0-1 TP1 PP1 DP2", "language: ranks 0-1 TP1 PP2 DP1")),
    "nemotron-fan-out-ep2": ("nemotron", ("--encoder-tp", "2", "--llm-ep", "2"),
                             ("images: ranks 0-1 TP2 PP1 DP1", "language: ranks 0-1 TP1 PP1 DP2 EP2")),
    "nemotron-pp2": ("nemotron", ("--llm-pp", "2"),
                     ("images: ranks 0-1 TP1 PP1 DP2", "language: ranks 0-1 TP1 PP2 DP1")),
}


def train(folder, name, *args):
    metrics = folder / f"{name}.jsonl"
    result = run_mimo(*RUN, *args, "--metrics-file", str(metrics))
    assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
    return read_metrics(metrics), result.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """provider -> (its start checkpoint's options, one process's metrics from there), made when first asked."""
    made = {}

    def get(provider):
        if provider not in made:
            folder = tmp_path_factory.mktemp(provider)
            saved = run_mimo(*RUN, *PROVIDERS[provider], "--train-iters", "1", "--save", str(folder / "start"))
            assert saved.returncode == 0, saved.stderr[-3000:]
            start = (*PROVIDERS[provider], *TRAIN, "--pretrained", str(folder / "start"))
            made[provider] = folder, start, train(folder, "single", *start)[0]
        return made[provider]

    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trains_like_one_process(reference, name):
    provider, layout, banner = LAYOUTS[name]
    folder, start, expected = reference(provider)
    got, stdout = train(folder, name, *start, "--nproc-per-node", "2", *layout)
    assert all(module in stdout for module in banner)
    assert len(got) == len(expected) == 6  # four iterations, two evaluations
    for ref, other in zip(expected, got):
        assert ref.get("split") == other.get("split")
        for key in KEYS if ref["split"] == "train" else ("lm_loss", "num_tokens"):
            assert other[key] == pytest.approx(ref[key], rel=1e-5), (name, ref["iteration"], key)


RESUMES = {  # saved on one layout, resumed on another
    "fan-in-to-colocated": (("--llm-tp", "2"), ()),
    "pp2-to-fan-out": (("--llm-pp", "2"), ("--encoder-tp", "2")),
    "colocated-to-pp2": ((), ("--llm-pp", "2")),
}


@pytest.mark.parametrize("name", list(RESUMES))
def test_a_checkpoint_resumes_on_another_layout_with_the_same_next_losses(reference, name):
    saved_on, resumed_on = RESUMES[name]
    folder, start, expected = reference("mock")
    save = folder / f"{name}-save"
    train(folder, f"{name}-first", *start, "--train-iters", "2", "--save", str(save), "--nproc-per-node", "2",
          *saved_on)
    resumed, stdout = train(folder, f"{name}-resumed", *PROVIDERS["mock"], *TRAIN, "--load", str(save),
                            "--nproc-per-node", "2", *resumed_on)
    assert "resumed from" in stdout
    later = [r for r in expected if r["iteration"] > 2]
    assert [(r["split"], r["iteration"]) for r in resumed] == [(r["split"], r["iteration"]) for r in later]
    for ref, other in zip(later, resumed):
        for key in KEYS if ref["split"] == "train" else ("lm_loss", "num_tokens"):
            assert other[key] == pytest.approx(ref[key], rel=1e-5), (name, ref["iteration"], key)


def test_with_data_each_rank_reads_its_share_of_the_lane_as_one_process_reads_it(tmp_path):
    """--data: the lane loader hands each rank its encoders' share (lane_part); the lane's rows are assembled from
    the shares, so the run is one process's (one lane: the same samples)."""
    from mimo.data import write_sample_dataset

    dataset = write_sample_dataset(tmp_path / "captions", num_samples=48, seed=2, shard_size=8)
    data = ("--provider", "mock-vlm", "--data", str(dataset.path), "--num-workers", "1", "--no-pack-sequences")
    assert run_mimo(*RUN, *data, "--train-iters", "1", "--save", str(tmp_path / "start")).returncode == 0
    start = (*data, "--train-iters", "3", "--pretrained", str(tmp_path / "start"))
    expected, _ = train(tmp_path, "single", *start)
    for name, layout in (("fan-in", ("--llm-tp", "2")), ("pp2", ("--llm-pp", "2"))):
        got, _ = train(tmp_path, name, *start, "--nproc-per-node", "2", *layout)
        assert len(got) == len(expected) == 3
        for ref, other in zip(expected, got):
            for key in KEYS:
                assert other[key] == pytest.approx(ref[key], rel=1e-5), (name, ref["iteration"], key)
