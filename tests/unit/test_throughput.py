"""Throughput that counts work, not padding (issue 61): with what `--data` counted, an interval's tokens are its
samples' own, its samples are samples (not packs), and its FLOPs those of the samples run (the provider's
`sample_flops`, each sample its own length and images); synthetic data, whose rows are whole samples, keeps the
batch shape's figures. The `mimo run` check against a dataset's micro-batches: tests/multiprocess/
test_data_throughput.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mimo.core.config import LoggingOptions
from mimo.core.run.step import StepResult
from mimo.core.telemetry.metrics import MetricsLogger, format_line
from mimo.core.telemetry.sample_flops import SampleFlops
from mimo.core.telemetry.summary import summary_lines
from mimo.core.telemetry.timers import StepTimers
from mimo.data import DataCounts
from mimo.data.lane_stream import count_work
from mimo.plugins import Registry
from mimo.plugins.data import ConversationTaskEncoder
from test_packing import mock_vlm, nemotron_tiny, samples

CPU = torch.device("cpu")
SEQ, BATCH, WORLD = 64, 4, 2


def logger(flops_per_row=1000.0, data_start=None, peak=None) -> MetricsLogger:
    return MetricsLogger(LoggingOptions(log_interval=2, peak_tflops=peak), total_iters=10, enabled=False,
                         global_batch_size=BATCH, tokens_per_iteration=BATCH * SEQ,
                         flops_per_iteration=3 * flops_per_row * BATCH if flops_per_row else None, world_size=WORLD,
                         device=CPU, timers=StepTimers(False, modules=[], held=[], device=CPU),
                         data_start=data_start)


def result(data=None, num_tokens=100) -> StepResult:
    return StepResult(lm_loss=2.0, num_tokens=num_tokens, grad_norm=1.0, skipped=False, lr=1e-3,
                      module_grad_norms={}, data=data)


def interval_seconds(record) -> float:
    return record["elapsed_ms"] / 1000 * 2  # two iterations an interval


def test_synthetic_data_keeps_the_batch_shapes_figures():
    """No counts: global batch x seq_length tokens a step and model_flops per row, as before the counts."""
    log = logger()
    assert log.update(1, result(), BATCH) is None
    record = log.update(2, result(), 2 * BATCH)
    seconds = record["elapsed_ms"] / 1000  # per iteration
    assert record["tokens_per_sec_per_gpu"] == pytest.approx(BATCH * SEQ / seconds / WORLD, rel=1e-12)
    assert record["tokens_per_sec"] == pytest.approx(BATCH * SEQ / seconds, rel=1e-12)
    assert record["tflops_per_gpu"] == pytest.approx(3 * 1000.0 * BATCH / seconds / WORLD / 1e12, rel=1e-12)
    assert record["loss_tokens_per_sec_per_gpu"] == pytest.approx(100 / seconds / WORLD, rel=1e-12)
    assert record["consumed_samples"] == 2 * BATCH and "consumed_rows" not in record
    assert record["tokens_counted"] == "rows" and record["flops_counted"] == "rows"
    assert not {"padding_share", "samples_per_sec", "row_tokens_per_sec_per_gpu"} & set(record)
    assert "padding" not in format_line(record, 10)


def test_data_counts_give_the_samples_tokens_samples_images_and_flops():
    """A resumed run's first interval counts from what the data had counted at the start, not from zero; the
    samples are the data's count (packs hold several), the rows stay beside them."""
    start = DataCounts(samples=500, tokens=60_000, rows=40, images=300, flops=10**15)
    log = logger(data_start=start, peak=100.0)
    after = DataCounts(samples=548, tokens=60_128, rows=48, images=330, flops=10**15 + 6 * 10**12)
    log.update(1, result(DataCounts(samples=520, tokens=60_064, rows=44, images=310, flops=10**15 + 10**12)), 44)
    record = log.update(2, result(after, num_tokens=700), 48)
    seconds = interval_seconds(record)
    assert record["tokens_per_sec_per_gpu"] == pytest.approx(128 / seconds / WORLD, rel=1e-12)
    assert record["row_tokens_per_sec_per_gpu"] == pytest.approx(8 * SEQ / seconds / WORLD, rel=1e-12)
    assert record["padding_share"] == pytest.approx(1 - 128 / (8 * SEQ))
    assert record["samples_per_sec"] == pytest.approx(48 / seconds, rel=1e-12)
    assert record["images_per_sec"] == pytest.approx(30 / seconds, rel=1e-12)
    assert record["samples_per_row"] == 6
    assert record["loss_tokens_per_sec_per_gpu"] == pytest.approx(800 / seconds / WORLD, rel=1e-12)
    assert record["tflops_per_gpu"] == pytest.approx(3 * 6e12 / seconds / WORLD / 1e12, rel=1e-9)
    assert record["mfu"] == pytest.approx(record["tflops_per_gpu"] / 100.0)
    assert record["tokens_counted"] == "non-padding" and record["flops_counted"] == "samples"
    assert record["consumed_samples"] == 548 and record["consumed_rows"] == 48
    assert "padding 75%" in format_line(record, 10)

    # the next interval from this record's counts
    later = DataCounts(samples=560, tokens=60_320, rows=52, images=330, flops=10**15 + 7 * 10**12)
    log.update(3, result(later), 52)
    record = log.update(4, result(later), 52)
    assert record["padding_share"] == pytest.approx(1 - 192 / (4 * SEQ))
    assert log.trained_tokens == 128 + 192 and log.trained_row_tokens == 12 * SEQ


def test_without_sample_flops_the_flops_are_model_flops_per_row():
    log = logger(flops_per_row=500.0, data_start=DataCounts())
    log.update(1, result(DataCounts(samples=10, tokens=300, rows=4)), 4)
    record = log.update(2, result(DataCounts(samples=20, tokens=600, rows=8)), 8)
    assert record["flops_counted"] == "rows"
    assert record["tflops_per_gpu"] == pytest.approx(3 * 500.0 * 8 / interval_seconds(record) / WORLD / 1e12)


def test_the_closing_summary_says_the_samples_tokens():
    log = logger(data_start=DataCounts())
    log.update(1, result(DataCounts(samples=10, tokens=64, rows=4)), 4)
    log.update(2, result(DataCounts(samples=20, tokens=128, rows=8)), 8)
    session = SimpleNamespace(plan=SimpleNamespace(train_iters=2, config=SimpleNamespace(
        logging=LoggingOptions())), logger=log, iteration=2, evaluations=None, checkpointer=None)
    line = summary_lines(session, 0, 3.0)[0]
    assert line.endswith(" tokens/s not counting padding (75% of the rows)"), line
    assert f"{log.trained_tokens / log.trained_seconds:,.0f} tokens/s" in line


def test_counts_of_an_older_checkpoint_load_with_the_new_fields_at_zero():
    saved = {"samples": 7, "unreadable": 1, "unsupported": 0, "too_long": 2, "cut_tokens": 3,
             "cut_answer_tokens": 1, "answer_tokens": 90, "data_error": 0}  # a lane's counts before this change
    counts = DataCounts(**saved)
    assert (counts.tokens, counts.images, counts.rows, counts.flops) == (0, 0, 0, 0)
    assert DataCounts.from_vector(counts.vector()) == counts


# -------------------------------------------------------------------------------------------- one sample's FLOPs


def provider_flops(name: str, settings):
    return SampleFlops(Registry().hooks(name), settings)


@pytest.mark.parametrize("provider, name", [(mock_vlm, "mock-vlm"), (nemotron_tiny, "nemotron-moe-vlm-tiny")])
def test_a_packs_flops_are_the_sum_of_its_samples(provider, name):
    """Each packed sample counts its own length (attention within it) and its own images' patches."""
    _, settings, _, encoder_args = provider()
    flops = provider_flops(name, settings)
    encoder = ConversationTaskEncoder(**encoder_args, pack_sequences=True)
    encoded = [encoder.encode_sample(s) for s in samples()]
    groups = encoder.select_samples_to_pack(encoded)
    group = max(groups, key=len)
    assert len(group) > 1 and sum(len(s.images) for s in group) > 1, "the test needs a pack of samples with images"
    pack = encoder.pack_selected_samples(group)

    counts = DataCounts()
    assert count_work(counts, pack, flops)
    patches = lambda s: [n for image in s.images for n in image.encoder_patches]  # noqa: E731
    assert counts.flops == round(sum(flops(len(s.tokens), patches(s)) for s in group))
    assert counts.tokens == sum(len(s.tokens) for s in group) == len(pack.tokens)  # no padding inside a pack
    assert (counts.rows, counts.images) == (1, sum(len(s.images) for s in group))
    assert pack.image_counts == [len(s.images) for s in group]  # each sample with its own images
    # the provider's hook over each whole sample, as its hookspec defines it
    hooks = Registry().hooks(name)
    direct = sum(sum(hooks.sample_flops(settings=settings, tokens=len(s.tokens), image_patches=patches(s)).values())
                 for s in group)
    assert counts.flops == pytest.approx(direct, rel=1e-12)


def test_sample_flops_at_the_synthetic_shape_give_model_flops():
    from mimo.providers.mock_vlm import MockVLMSettings
    from mimo.providers.mock_vlm.model import forward_flops as mock_flops
    from mimo.providers.mock_vlm.model import sample_flops as mock_sample
    from mimo.providers.nemotron import TINY, NemotronVLMSettings
    from mimo.providers.nemotron.flops import forward_flops, sample_flops

    s = NemotronVLMSettings(**{**TINY, "patches_per_image": 36, "images_per_sample": 2})
    assert sample_flops(s, s.seq_length, [36, 36]) == pytest.approx(forward_flops(s), rel=1e-12)
    m = MockVLMSettings(images_per_sample=2)
    assert mock_sample(m, m.seq_length, [m.image_tokens] * 2) == pytest.approx(mock_flops(m), rel=1e-12)
    # fewer tokens: attention within the sample's own length, less than the row's
    assert sample_flops(s, 100, [])["language"] < 100 / s.seq_length * forward_flops(s)["language"]


def test_sample_flops_ask_for_each_part_once_and_stop_without_the_hook():
    calls = []

    def hook(settings, tokens, image_patches):
        calls.append((tokens, tuple(image_patches)))
        return {"language": 10.0 * tokens, "images": 3.0 * sum(image_patches)}

    flops = SampleFlops(SimpleNamespace(sample_flops=hook), settings=None)
    assert flops(5, [4, 4]) == 50 + 12 + 12
    assert flops(5, [4]) == 62 and flops(7, []) == 70
    assert calls == [(5, ()), (0, (4,)), (7, ())]
    missing = SampleFlops(SimpleNamespace(sample_flops=lambda **kwargs: calls.append(kwargs)), settings=None)
    assert missing(5, []) is None and missing(6, [2]) is None and len(calls) == 4
    counts = DataCounts()
    assert not count_work(counts, SimpleNamespace(seqlens=[3, 4], images=[], tokens=[0] * 7), missing)
    assert (counts.tokens, counts.rows, counts.flops) == (7, 1, 0)
