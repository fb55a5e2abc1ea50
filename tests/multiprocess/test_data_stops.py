"""Skips counted as samples at consumption, packed or not, and the stops they cause: the held-out cases of issue 32.

- 1 bad sample in 15 (6.7%) trains to the end; 2 in 16 (12.5%) stops on --max-skip-fraction 0.1 and saves first;
- with packing, the count is exactly the bad samples whose stream successor training consumed;
- a blend with 22% of its samples too long for seq_length counts them as too long (not unreadable), exactly, and
  its stop names seq_length;
- a Bridge-class dataset (a sample class that cannot be imported) is one line; a sample without the part its
  field map names is named with its shard; a micro-batch larger than the data says it repeats samples;
- a dataset that turns all-bad stops at the boundary with the last full iteration saved.
"""

from __future__ import annotations

import json

import pytest

from helpers import read_metrics, run_mimo
from test_data_skips import SHARD_SIZE, consumed_rows, passed_bad_keys, write_dataset
from mimo.data import ByteTokenizer, ConversationTaskEncoder, FixedTiles, LaneLoader, PLAIN

LONG, FITS = 64, 512  # mock-vlm's seq_length, and one every sample fits


def mock_encoder(seq_length=LONG, pack=False):
    tokenizer = ByteTokenizer(vocab_size=320, special_tokens=PLAIN.special_tokens)
    return ConversationTaskEncoder(tokenizer, template=PLAIN, seq_length=seq_length, pack_sequences=pack,
                                   image_mode=FixedTiles(image_size=16, patch_size=8))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from format_datasets import picture, prepare, write

    root = tmp_path_factory.mktemp("stops")
    write_dataset(root / "ds15", bad=(7,), num_samples=15)
    write_dataset(root / "ds16", bad=(3, 11), num_samples=16)
    write_dataset(root / "clean64", num_samples=64)
    write_dataset(root / "bad64", bad=(5, 20, 21, 40), num_samples=64)
    shards = write_dataset(root / "missing", missing=(5,), num_samples=16)
    # VQA whose questions are too long for seq_length 64 in 11 of 25 (44%): 22% of a 1:1 blend with captions
    long_keys = {f"q{i:03d}" for i in range(25) if i % 9 in (1, 3, 5, 7)}
    samples = []
    for i in range(25):
        key = f"q{i:03d}"
        question = ("Describe every detail of this picture, slowly. " * 3 if key in long_keys else "What is it?")
        samples.append({"__key__": key, "jpg": picture((24, 24, "RGB", "jpg"), "red")[0],
                        "json": {"q": question, "answers": ["a red disc"]}})
    write(root / "vqa", samples)
    prepare(root / "vqa", "VQASample", {"image": "jpg", "context": "json[q]", "answers": "json[answers]"})
    write_dataset(root / "captions", num_samples=25)
    (root / "blend.yaml").write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n"
                                     "    blend:\n      - weight: 1\n        path: captions\n"
                                     "      - weight: 1\n        path: vqa\n")
    # a class of a Megatron-Bridge module that this environment cannot import and mimo does not know (its
    # ChatMLWebdataset mimo reads: tests/multiprocess/test_foreign_samples.py)
    write_dataset(root / "bridge", num_samples=8)
    (root / "bridge" / ".nv-meta" / "dataset.yaml").write_text(
        "__module__: megatron.bridge.recipes.qwen_vl.data.energon.task_encoder\n__class__: UnknownWebdataset\n"
        "field_map:\n  imgs: jpg\n  conversation: json\n")
    # 16 good samples, then 120 unreadable ones: the data turns all-bad mid-run
    write_dataset(root / "turns_bad", bad=tuple(range(16, 136)), num_samples=136, shard_size=136)
    return root, long_keys, shards


def run(tmp_path, data_path, *args):
    metrics = tmp_path / "m.jsonl"
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--data", str(data_path),
                      "--metrics-file", str(metrics), "--log-interval", "1", *args)
    return (read_metrics(metrics) if metrics.exists() else []), result


@pytest.mark.parametrize("name, stops", [("ds15", False), ("ds16", True)])
def test_bad_shares_of_6_7_and_12_5_percent_with_the_defaults(tmp_path, data, name, stops):
    """Packing and two workers (the defaults): 6.7% trains to the end, 12.5% stops on 10% and saves first."""
    root, _, _ = data
    save = tmp_path / "save"
    records, result = run(tmp_path, root / name, "--train-iters", "40", "--save", str(save))
    last = records[-1]
    share = last["skipped_samples"] / (last["skipped_samples"] + last["samples"])
    assert last["skipped_samples"] == last["skipped_unreadable"]
    assert last["samples"] >= last["consumed_samples"]  # samples, not packed rows
    if not stops:
        assert result.returncode == 0, result.stderr[-2000:]
        assert last["iteration"] == 40 and 0.03 < share < 0.1 and (save / "iter_0000040").is_dir()
        return
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    at = last["iteration"]
    assert 0.1 < share < 0.16 and at < 40 and last["samples"] + last["skipped_samples"] >= 100
    assert line == (f"error: {last['skipped_samples']} of the {last['samples'] + last['skipped_samples']} samples "
                    f"read were skipped ({share:.1%}: {last['skipped_samples']} unreadable), more than "
                    f"--max-skip-fraction 0.1: the lines above name them; repair --data {root / name}, or raise "
                    f"--max-skip-fraction; saved iteration {at} in {save} (resume with --load {save})")
    assert (save / f"iter_{at:07d}" / "common.pt").is_file()
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(at)


def test_a_packed_count_is_exact(data):
    """With packing, a skipped sample counts when the pack of its stream successor is consumed: exactly those."""
    root, _, _ = data
    bad_keys = {f"img{i:04d}" for i in (5, 20, 21, 40)}
    options = dict(micro_batch_size=2, num_lanes=1, num_workers=1, seed=2, shuffle_buffer_size=8)
    reference = LaneLoader(root / "clean64", mock_encoder(), **options)
    stream = [key for _, key in consumed_rows(reference, 30)[0]]  # 60 of 64: no key twice
    reference.close()
    loader = LaneLoader(root / "bad64", mock_encoder(pack=True), packing_buffer_size=16, **options)
    rows, records = consumed_rows(loader, 12)
    counts = loader.data_counts()
    loader.close()
    consumed = {key for _, packed in rows for key in packed.split(",")}
    successor = {}
    for i, key in enumerate(stream):
        if key in bad_keys:
            successor[key] = next(k for k in stream[i:] if k not in bad_keys)
    expected = {key for key, after in successor.items() if after in consumed}
    assert expected and sorted(r.key for r in records) == sorted(expected)
    assert counts.unreadable == len(expected) and counts.samples == len(consumed) > len(rows)


def test_a_blend_with_22_percent_too_long(tmp_path, data):
    """Too long for seq_length, not unreadable: counted exactly, per reason; the stop names seq_length."""
    root, long_keys, _ = data
    options = dict(micro_batch_size=2, num_lanes=1, num_workers=1, seed=4, shuffle_buffer_size=None)
    reference = LaneLoader(root / "blend.yaml", mock_encoder(FITS), **options)
    clean_rows, _ = consumed_rows(reference, 40)
    reference.close()
    loader = LaneLoader(root / "blend.yaml", mock_encoder(), **options)
    rows, records = consumed_rows(loader, 10)
    counts = loader.data_counts()
    loader.close()
    expected = passed_bad_keys(clean_rows, rows, long_keys)
    assert expected and sorted(r.key for r in records) == sorted(expected)
    assert counts.too_long == len(expected) and counts.unreadable == counts.unsupported == 0
    assert all(r.reason == "too_long" and r.needed_tokens > LONG and "raise seq_length" in r.error for r in records)

    save = tmp_path / "save"
    records, result = run(tmp_path, root / "blend.yaml", "--train-iters", "40", "--save", str(save))
    assert result.returncode == 2, result.stderr[-2000:]
    last = records[-1]
    share = last["skipped_too_long"] / (last["samples"] + last["skipped_samples"])
    assert last["skipped_samples"] == last["skipped_too_long"] and 0.15 < share < 0.3
    (line,) = result.stderr.strip().splitlines()
    assert f"too long for seq_length {LONG}), more than --max-skip-fraction 0.1" in line
    assert "raise seq_length (--set seq_length=N)" in line and "repair" not in line
    assert line.endswith(f"; saved iteration {last['iteration']} in {save} (resume with --load {save})")
    assert "skipped a sample (too long for seq_length): dataset " in result.stdout


def test_a_bridge_class_dataset_is_one_line(tmp_path, data):
    root, _, _ = data
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--data", str(root / "bridge"),
                      "--train-iters", "2")
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --data {root / 'bridge'}: .nv-meta/dataset.yaml names the sample class "
                           f"megatron.bridge.recipes.qwen_vl.data.energon.task_encoder.UnknownWebdataset, which "
                           f"cannot be imported here (No module named 'megatron.bridge'); mimo reads ")
    assert "mimo data convert llava" in line


def test_a_missing_part_names_its_shard_and_a_small_dataset_says_it_repeats(data):
    root, _, shards = data
    loader = LaneLoader(root / "missing", mock_encoder(), micro_batch_size=4, num_lanes=1, num_workers=0, seed=1,
                        shuffle_buffer_size=None)
    _, records = consumed_rows(loader, 5)
    assert loader.size_note() is None
    loader.close()
    (record,) = records
    assert (record.key, record.reason, record.shard, record.dataset) == (
        "img0005", "unreadable", shards["img0005"], str(root / "missing"))
    assert "field map" in record.error and "parts: jpg" in record.error
    small = LaneLoader(root / "ds15", mock_encoder(), micro_batch_size=16, num_lanes=1, num_workers=0, seed=1)
    assert small.size_note() == (f"note: --data {root / 'ds15'} has 15 training samples per data lane, fewer than "
                                 f"a micro-batch of 16: every micro-batch repeats samples (each about 2 times)")
    small.close()


def test_data_that_turns_all_bad_stops_at_the_boundary_saved(tmp_path, data):
    root, _, _ = data
    save = tmp_path / "save"
    records, result = run(tmp_path, root / "turns_bad", "--train-iters", "20", "--save", str(save),
                          "--micro-batch-size", "2", "--num-workers", "1", "--no-pack-sequences",
                          "--set", "shuffle_buffer=0", "--max-skip-fraction", "1")
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line == (f"error: --data {root / 'turns_bad'}: the last 100 samples read were all skipped (100 "
                    f"unreadable): repair the dataset (the lines above name the samples); saved iteration 8 in "
                    f"{save} (resume with --load {save})")
    assert [r["iteration"] for r in records][-1] == 9 and (save / "iter_0000008" / "common.pt").is_file()
    assert not (save / "iter_0000009").exists()
    assert json.loads(json.dumps(records[-2]))["samples"] == 16


def test_images_over_a_packed_rows_budget_are_counted_apart_from_too_long(data):
    """A packed row's image budget below every sample's images: each is skipped as over the image budget (its own
    reason and hint: a longer seq_length would not help), not as too long for seq_length, and the loader gives up
    after a run of them with the hint for that reason."""
    from mimo.data.lane_stream import DataError

    root, _, _ = data
    encoder = mock_encoder(FITS, pack=True)
    encoder.image_token_budget = 2  # every image takes 4 tokens (16-pixel images of 8-pixel patches)
    loader = LaneLoader(root / "clean64", encoder, micro_batch_size=2, num_lanes=1, num_workers=1, seed=4,
                        shuffle_buffer_size=None)
    with pytest.raises(DataError, match=r"the last 100 samples read were all skipped \(100 images over a packed "
                                        r"row's image budget\): make the images smaller or raise --pack-image-tokens"):
        consumed_rows(loader, 4)
    counts = loader.data_counts()
    loader.close()
    assert counts.over_image_budget >= 100 and counts.too_long == counts.unreadable == counts.samples == 0
