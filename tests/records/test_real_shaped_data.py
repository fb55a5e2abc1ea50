"""bench/real_shaped_data.py: its records hold the documented mix, its images are what their specs say, and a few
dozen records convert with `mimo data convert llava` into a dataset the tiny model trains on and the mid model's
loader reads without a skip."""

import json
import math
import os
import subprocess
import sys

import pytest

from helpers import REPO, run_mimo

sys.path.insert(0, str(REPO / "bench"))
try:
    import real_shaped_data
    import real_shaped_records as records
finally:
    sys.path.remove(str(REPO / "bench"))


def within(share: float, expected: float, n: int) -> bool:
    """`share` of `n` draws is `expected`'s within four standard deviations."""
    return abs(share - expected) <= 4 * math.sqrt(expected * (1 - expected) / n)


def test_the_records_hold_the_mix():
    plans = [records.plan_record(0, i) for i in range(500)]
    mix = real_shaped_data.mix_figures(plans)
    n, images = mix["records"], mix["images"]
    for share, expected in ((mix["text_only_share"], 0.10), (mix["two_image_share"], 0.10)):
        assert within(share, expected, n), mix
    for kind, expected in records.SIZE_CLASSES:
        assert within(mix["class_shares"][kind], expected, images), (kind, mix["class_shares"])
    assert set(mix["rounds"]) == {1, 2, 3, 4, 5} and within(mix["rounds"][1], 0.40, n)
    answers, questions = mix["answer_words"], mix["question_words"]
    assert 25 <= answers["p50"] <= 40 and answers["p10"] >= 5 and answers["p90"] <= 140 and answers["max"] >= 200
    assert 6 <= questions["p50"] <= 12 and questions["max"] <= 34  # "Image 1: <image>" adds four

    from mimo.data.conversation import place_images, turns_from_chat_json

    for record, specs in plans:
        human = [turn["value"] for turn in record["conversations"][::2]]
        assert {turn["from"] for turn in record["conversations"][::2]} == {"human"}
        assert sum(text.count("<image>") for text in human) == len(specs) and ("image" in record) == bool(specs)
        assert "<image>" in human[0] or not specs  # LLaVA's place: the first question
        place_images(turns_from_chat_json(record), len(specs))  # the cooker's own check
        for spec in specs:
            w, h = sorted((spec.width, spec.height))
            assert {"crop": 96 <= w <= h <= 320, "photo": 640 <= h <= 1600 and h / w <= 16 / 9 + 0.01,
                    "frame": (w, h) == (1080, 1920), "screenshot": (spec.width, spec.height) in records.PHONES,
                    "panorama": 2.5 <= h / w <= 4.01 and spec.width > spec.height}[spec.kind], spec
    # the same seed draws the same records; the first records of a larger set are the same; another seed differs
    assert records.plan_record(0, 7) == plans[7] and records.plan_record(1, 7) != plans[7]


def test_the_images_are_what_their_specs_say(tmp_path):
    from PIL import Image

    plans = records.write_source(tmp_path, 40, seed=0)
    assert json.loads((tmp_path / "llava.json").read_text()) == [record for record, _ in plans]
    bits_per_pixel = []
    for spec in (spec for _, specs in plans for spec in specs):
        path = tmp_path / "images" / spec.name
        with Image.open(path) as image:
            assert (image.size, image.format, image.mode) == ((spec.width, spec.height), spec.format, "RGB")
        if spec.format == "JPEG" and spec.kind != "crop":
            bits_per_pixel.append(8 * path.stat().st_size / (spec.width * spec.height))
    # photos cost what photos do to store and decode, not what a flat picture does
    assert len(bits_per_pixel) > 20 and 0.4 < min(bits_per_pixel) and max(bits_per_pixel) < 2.5, bits_per_pixel
    spec = next(spec for _, specs in plans for spec in specs if spec.kind == "photo")
    assert records.draw(spec, 0, records.textures(0)) == (tmp_path / "images" / spec.name).read_bytes()


def test_two_writers_write_the_same_files(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    records.write_source(one, 12, seed=3)
    records.write_source(two, 12, seed=3, workers=2)
    names = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(two) for p in two.rglob("*") if p.is_file())
    assert all((one / name).read_bytes() == (two / name).read_bytes() for name in names)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """24 records of seed 1 written and converted by the script: every size class, both formats, text-only and
    two-image records among them."""
    out = tmp_path_factory.mktemp("real") / "data"
    plans = [records.plan_record(1, i) for i in range(24)]
    kinds = {spec.kind for _, specs in plans for spec in specs}
    assert kinds == {kind for kind, _ in records.SIZE_CLASSES} and {len(s) for _, s in plans} == {0, 1, 2}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(REPO / "bench" / "real_shaped_data.py"), "--out", str(out),
                             "--records", "24", "--seed", "1", "--shard-size", "10", "--provider",
                             "nemotron-moe-vlm-tiny"], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "converted 24 of 24 records" in result.stdout and "train on it: mimo run" in result.stdout
    return out, json.loads((out / "real_shaped_data.json").read_text())


def test_a_few_dozen_records_convert_and_the_tiny_model_trains_on_them(converted):
    out, summary = converted
    assert (summary["train"], summary["skipped"], summary["records"]) == (24, 0, 24)
    assert sorted(p.name for p in (out / "dataset").glob("*.tar")) == ["train-000000.tar", "train-000001.tar",
                                                                        "train-000002.tar"]
    tokens = summary["tokens"]
    assert tokens["seq_length"] == 256 and tokens["tokens_per_sample"]["max"] > 256  # the tiny model cuts some
    again = subprocess.run([sys.executable, str(REPO / "bench" / "real_shaped_data.py"), "--out", str(out),
                            "--records", "24", "--seed", "1"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout.startswith(f"{out / 'dataset'}: kept"), again.stderr[-3000:]
    trained = run_mimo("run", "--provider", "nemotron-moe-vlm-tiny", "--device", "cpu", "--data",
                       str(out / "dataset"), "--num-workers", "1", "--train-iters", "2", "--log-interval", "1")
    assert trained.returncode == 0 and trained.stderr == "", trained.stderr[-3000:]
    assert "iteration      2/2" in trained.stdout and "skipped samples" not in trained.stdout, trained.stdout


def test_the_mid_models_loader_reads_the_dataset_without_a_skip(converted):
    """nemotron-moe-vlm-mid's own data path (RADIO's dynamic resolution up to 2048 patches, sequence 2048, packed)
    reads every size class; its training is measured on a GPU."""
    from mimo.plugins import DataContext, Registry
    from mimo.plugins.settings import build_settings

    out, _ = converted
    registry = Registry()
    settings = build_settings(registry.get("nemotron-moe-vlm-mid")[0])
    ctx = DataContext(micro_batch_size=2, num_microbatches=1, num_lanes=1, seed=0, data_path=str(out / "dataset"),
                      num_workers=1, pack_sequences=True, packing_buffer_size=8)
    loader = registry.hooks("nemotron-moe-vlm-mid").data_provider(settings=settings, ctx=ctx)
    try:
        batches = [next(loader) for _ in range(6)]
        assert loader.skipped_samples == 0
    finally:
        loader.close()
    patches = [batch["modality_inputs"]["images"]["radio"]["x"].shape[1] for batch in batches
               if batch["modality_inputs"]]
    assert patches and max(patches) > 2048  # packed rows carry several images, a frame alone is 2048 patches
    assert all(batch["input_ids"].shape == (1, 2 * settings.seq_length) for batch in batches)
