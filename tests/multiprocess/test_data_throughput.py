"""`mimo run --data` reports the work its micro-batches are (issue 61): the tokens it logs are the non-padding
tokens of the micro-batches it ran, its consumed samples are samples (several to a packed row), and its TFLOP/s
the FLOPs of each sample's own length and images. The reference reads the same stream in this process through
mock-vlm's loader and counts each micro-batch itself; the interval's figures: tests/unit/test_throughput.py."""

from __future__ import annotations

import pytest

from helpers import read_metrics, run_mimo
from mimo.data import DataCounts, write_sample_dataset
from mimo.plugins import DataContext, Registry
from mimo.plugins.settings import build_settings

ITERATIONS, MICRO_BATCH, SEED, SEQ, WORKERS, BUFFER = 3, 2, 7, 256, 1, 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_sample_dataset(tmp_path_factory.mktemp("ds") / "captions", num_samples=48, seed=5, shard_size=8)


def mock_vlm():
    registry = Registry()
    return registry.hooks("mock-vlm"), build_settings(registry.get("mock-vlm")[0], [f"seq_length={SEQ}"])


def loader_of(path, packed: bool):
    """mock-vlm's loader for the one lane of a one-rank run with the test's options (as core/run/world.py makes
    its DataContext), with no FLOP count of its own."""
    hooks, settings = mock_vlm()
    ctx = DataContext(micro_batch_size=MICRO_BATCH, num_microbatches=1, num_lanes=1, seed=SEED,
                      data_path=str(path), num_workers=WORKERS, pack_sequences=packed, packing_buffer_size=BUFFER,
                      pack_image_tokens=SEQ if packed else None)  # a CPU run's image budget: a whole row
    return hooks.data_provider(settings=settings, ctx=ctx), settings


def micro_batch_work(batch, keys, pad_id: int, settings) -> tuple[int, int, float]:
    """(non-padding tokens, samples, forward FLOPs) of one micro-batch, read off the batch itself: each sample's
    length (a packed row's THD boundaries, else the row's tokens that are not padding) through the GPT, each image
    (one tile of image_tokens patches) through the ViT and the projection."""
    from mimo.providers.mock_vlm.model import image_flops, language_flops

    tokens = int((batch["input_ids"] != pad_id).sum())
    if "packing_kwargs" in batch:
        lengths = [int(n) for n in batch["packing_kwargs"]["cu_seqlens_q"].diff() if n]
    else:
        lengths = [int(n) for n in (batch["input_ids"] != pad_id).sum(dim=1)]
    assert sum(lengths) == tokens
    images = batch["modality_inputs"].get("images", {}).get("vit", {}).get("x")
    count = 0 if images is None else images.shape[0]
    flops = sum(language_flops(settings, n) for n in lengths) + count * image_flops(settings, settings.image_tokens)
    return tokens, sum(key.count(",") + 1 for key in keys), flops


def replay(path, packed: bool) -> list[tuple[int, int, float]]:
    loader, settings = loader_of(path, packed)
    pad_id = loader.task_encoder.tokenizer.pad_id
    try:
        return [micro_batch_work(next(loader), [row[3] for row in loader.last_rows], pad_id, settings)
                for _ in range(ITERATIONS)]
    finally:
        loader.close()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_logged_tokens_samples_and_flops_are_those_of_the_micro_batches_run(tmp_path, dataset, packed):
    metrics = tmp_path / "m.jsonl"
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--data", str(dataset.path),
                      "--train-iters", str(ITERATIONS), "--log-interval", "1", "--micro-batch-size", str(MICRO_BATCH),
                      "--num-workers", str(WORKERS), "--seed", str(SEED), "--set", f"seq_length={SEQ}",
                      "--packing-buffer-size", str(BUFFER), "--metrics-file", str(metrics),
                      *(() if packed else ("--no-pack-sequences",)))
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(metrics)
    assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))
    samples = 0
    for record, (tokens, count, flops) in zip(records, replay(dataset.path, packed)):
        seconds = record["elapsed_ms"] / 1000  # an interval of one iteration, one rank
        assert round(record["tokens_per_sec_per_gpu"] * seconds) == tokens, record["iteration"]
        assert record["padding_share"] == pytest.approx(1 - tokens / (MICRO_BATCH * SEQ))
        samples += count
        assert record["consumed_samples"] == samples and record["samples"] == samples
        assert record["consumed_rows"] == MICRO_BATCH * record["iteration"]
        assert record["flops_counted"] == "samples"
        assert record["tflops_per_gpu"] * 1e12 * seconds / 3 == pytest.approx(flops, rel=1e-9)
    assert (samples > MICRO_BATCH * ITERATIONS) == packed  # packed rows hold several samples
    last = [line for line in result.stdout.splitlines() if line.startswith("iteration")][-1]
    assert f"padding {records[-1]['padding_share']:.0%}" in last
    assert "tokens/s not counting padding" in result.stdout


def test_a_loader_state_from_before_the_work_counts_resumes(dataset):
    """A checkpoint's lane counts without tokens, images, rows and FLOPs (an older mimo's) load with them at 0, and
    what the lane trains after the resume counts on from there."""
    loader, _ = loader_of(dataset.path, packed=True)
    try:
        next(loader)
        state = loader.state_dict()
        before = loader.data_counts()
    finally:
        loader.close()
    for lane in state["lanes"].values():
        lane["counts"] = {k: v for k, v in lane["counts"].items() if k not in ("tokens", "images", "rows", "flops")}
    resumed, settings = loader_of(dataset.path, packed=True)
    try:
        resumed.load_state_dict(state)
        assert resumed.data_counts() == DataCounts(**{**vars(before), "tokens": 0, "images": 0, "rows": 0,
                                                      "flops": 0})
        batch = next(resumed)
        tokens, samples, _ = micro_batch_work(batch, [row[3] for row in resumed.last_rows],
                                              resumed.task_encoder.tokenizer.pad_id, settings)
        after = resumed.data_counts()
    finally:
        resumed.close()
    assert (after.tokens, after.rows, after.samples) == (tokens, MICRO_BATCH, before.samples + samples)
