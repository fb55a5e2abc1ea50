"""The memory plan reads --data's packs: it counts the image tokens of the largest pack the dataset makes through
the run's own packer, and the run's packer holds every row to that, in any order of the samples."""

from __future__ import annotations

import json
import random

import pytest
from PIL import Image

from mimo.core.config import CheckpointOptions, DataOptions, MemoryOptions, RunConfig, TrainingOptions
from mimo.core.memory import fit
from mimo.core.memory.pack_budget import GRAIN, describe
from mimo.core.run import pack_scan
from mimo.core.run.data_encoder import provider_encoder
from mimo.core.run.plan import prepare
from mimo.data.convert import convert_llava
from mimo.data.inspection import counted, inspect_dataset, pack_sizes
from mimo.data.sample_reader import SampleReader
from mimo.data.sample_view import Viewer
from mimo.plugins.context import packing_buffer_for

TINY = ["seq_length=128"]  # nemotron-moe-vlm-tiny: 16 to 64 patches an image, 4 patches a placeholder
SIZES = [(16, 16), (64, 64), (128, 96), (40, 200)]  # 4 to 16 image tokens an image


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """40 captioned records, none to two images of varying size each, converted as `mimo data convert llava`."""
    root = tmp_path_factory.mktemp("scan")
    (root / "images").mkdir()
    for i, size in enumerate(SIZES):
        Image.new("RGB", size, (30 * i, 90, 160)).save(root / "images" / f"{i}.png")
    pick, records = random.Random(0), []
    for i in range(40):
        images = [f"{pick.randrange(len(SIZES))}.png" for _ in range(i % 3)]
        marks = "".join("<image>\n" for _ in images)
        records.append({"id": f"r{i}", **({"image": images} if images else {}), "conversations": [
            {"from": "human", "value": f"{marks}Describe it."},
            {"from": "gpt", "value": "It is a box " * pick.randrange(1, 6)}]})
    (root / "llava.json").write_text(json.dumps(records))
    convert_llava(root / "llava.json", root / "images", root / "ds", say=lambda line: None)
    return root / "ds"


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(pack_scan, "_CACHE", {})
    monkeypatch.delenv(pack_scan.ENV, raising=False)


def config(path, gpu_memory=80.0, **data) -> RunConfig:
    data.setdefault("pack_scan_samples", 2000)  # opted in (the default, 0, reads nothing)
    return RunConfig(provider="nemotron-moe-vlm-tiny", provider_settings=list(TINY),
                     training=TrainingOptions(micro_batch_size=2, num_microbatches=2, device="cpu"),
                     data=DataOptions(data=path, **data), memory=MemoryOptions(gpu_memory=gpu_memory),
                     checkpoint=CheckpointOptions())


def packs(path, budget, shuffle: int | None = None, packed_at=...) -> list[tuple[int, int]]:
    """(tokens, image tokens) of each row the run's encoder packs of the whole dataset at `budget` (the rows
    packed at `packed_at`, when given, of the samples encoded at `budget`)."""
    encoder = provider_encoder(config(path)).encoder
    encoder.image_token_budget = budget
    viewer = Viewer(encoder)
    encoded = [counted(v.encoded) for v in map(viewer.view, SampleReader(path, encoder=encoder)) if v.encoded]
    if shuffle is not None:
        random.Random(shuffle).shuffle(encoded)
    if packed_at is not ...:
        encoder.image_token_budget = packed_at
    return pack_sizes(encoder, encoded, packing_buffer_for(encoder.seq_length))


def test_the_plan_counts_the_largest_pack_of_the_dataset(dataset):
    plan = prepare(config(dataset), world_size=1, planning=True)
    free = packs(dataset, 128)
    largest, scan = max(images for _, images in free), plan.pack_scan
    assert 0 < largest < 128 - GRAIN  # the dataset's packs carry fewer image tokens than a row holds
    assert plan.pack_image_tokens == -(-largest // GRAIN) * GRAIN
    assert scan.image_tokens == largest and scan.whole and scan.read == 40 and scan.rows == len(free)
    assert describe(plan) == (f"packs: rows of 128 tokens with at most {plan.pack_image_tokens} image tokens (the "
                              f"largest pack of all 40 --data samples: {largest}, {scan.mean_image_tokens:.0f} on "
                              f"average; {scan.as_full} pack them as full)")
    from mimo.cli.plan import describe as summary

    assert summary(plan)["pack_scan"] == {"read": 40, "samples": scan.samples, "rows": len(free),
                                          "image_tokens": largest, "whole": True, "as_full": scan.as_full,
                                          "mean_image_tokens": scan.mean_image_tokens}
    # the encoders' activations follow it, below a plan that counts whole rows of images
    [scanned] = fit.estimate_plan(plan)
    [whole] = fit.estimate_plan(prepare(config(dataset, pack_scan_samples=0), world_size=1, planning=True))
    images = lambda rank: next(m for m in rank.modules if m.module == "images")  # noqa: E731
    assert images(scanned).tokens / images(whole).tokens == pytest.approx(plan.pack_image_tokens / 128)
    assert scanned.term("activations") < whole.term("activations")


def test_the_scan_says_the_fewest_image_tokens_that_pack_the_dataset_as_full(dataset):
    scan = prepare(config(dataset), world_size=1, planning=True).pack_scan
    free, budget = packs(dataset, 128), scan.as_full
    assert 0 < budget <= -(-scan.image_tokens // GRAIN) * GRAIN and budget % GRAIN == 0  # the largest pack's, at most
    bounded = packs(dataset, budget)  # the same samples (none skipped: the same tokens) in as many rows
    assert len(bounded) == len(free) and sum(t for t, _ in bounded) == sum(t for t, _ in free)
    tighter = packs(dataset, budget - GRAIN)  # one grain fewer packs emptier, or skips a sample
    assert len(tighter) > len(free) or sum(t for t, _ in tighter) < sum(t for t, _ in free)


def test_the_runs_packer_holds_every_row_to_the_plans_figure_in_any_order(dataset):
    plan = prepare(config(dataset), world_size=1, planning=True)
    for seed in range(5):  # other shuffles make other rows; the budget closes any that would carry more
        assert max(images for _, images in packs(dataset, plan.pack_image_tokens, shuffle=seed)) \
            <= plan.pack_image_tokens


def test_no_scan_without_a_limit_or_when_told_and_a_stated_sample(dataset):
    unlimited = prepare(config(dataset, gpu_memory=None), world_size=1, planning=False)
    assert unlimited.pack_image_tokens == 128 and unlimited.pack_scan is None  # a CPU run: nothing enforced
    off = prepare(config(dataset, pack_scan_samples=0), world_size=1, planning=True)
    assert off.pack_image_tokens == 128 and describe(off).endswith("(a whole row)")
    few = prepare(config(dataset, pack_scan_samples=7), world_size=1, planning=True)
    assert few.pack_scan.read == 7 and not few.pack_scan.whole and "of the first 7 --data samples" in describe(few)
    given = prepare(config(dataset, pack_image_tokens=96), world_size=1, planning=True)
    assert given.pack_image_tokens == 96 and given.pack_scan is None  # the user's budget stands


def test_workers_take_the_launchers_scan_instead_of_reading_again(dataset, monkeypatch):
    first = prepare(config(dataset), world_size=1, planning=True).pack_scan
    monkeypatch.setattr(pack_scan, "_CACHE", {})  # a worker: a fresh process with the launcher's environment

    def read(*args):
        raise AssertionError("read again")

    monkeypatch.setattr(pack_scan, "_read", read)
    assert prepare(config(dataset), world_size=1, planning=True).pack_scan == first


def test_what_is_not_a_dataset_leaves_the_budget(tmp_path):
    plan = prepare(config(tmp_path), world_size=1, planning=True)
    assert plan.pack_image_tokens == 128 and plan.pack_scan is None


def test_inspect_packs_rows_to_the_image_budget(dataset):
    encoder = provider_encoder(config(dataset)).encoder
    encoder.image_token_budget = 16
    result = inspect_dataset(dataset, encoder=encoder, provider="nemotron-moe-vlm-tiny", limit=None)
    # the rows the run makes at that budget, more than the tokens alone make (inspect used to drop the images)
    assert sorted(result.rows) == sorted(tokens for tokens, _ in packs(dataset, 16))
    assert len(result.rows) > len(packs(dataset, 16, packed_at=None))


def test_plan_vs_peak_plans_a_recorded_run_with_its_options_on_the_dataset_made_again(monkeypatch):
    import importlib.util

    from helpers import REPO

    monkeypatch.syspath_prepend(str(REPO / "bench"))  # the script imports bench/common.py, as when run
    spec = importlib.util.spec_from_file_location("plan_vs_peak", REPO / "bench" / "plan_vs_peak.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    command = ("mimo run --provider nemotron-moe-vlm-52l --set 'hybrid_pattern=MEMEM*EMEM' --precision bf16 --device "
               "cuda --micro-batch-size 1 --train-iters 108 --log-interval 1 --data /gpu/real/dataset --metrics-file "
               "m.jsonl")
    assert script.plan_options(command, "here/dataset", 140.4) == [
        "--provider", "nemotron-moe-vlm-52l", "--set", "hybrid_pattern=MEMEM*EMEM", "--precision", "bf16",
        "--micro-batch-size", "1", "--device", "cuda", "--gpu-memory", "140.4", "--data", "here/dataset",
        "--pack-scan-samples", "2000"]
    synthetic = command.split(" --data")[0]
    assert "--data" not in script.plan_options(synthetic, "here/dataset", 140.4)
