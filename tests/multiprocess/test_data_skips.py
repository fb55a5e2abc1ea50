"""Bad samples: one line per skipped sample naming why, dataset, shard and key (rate-limited); energon's own prints
kept off the console; an exact skip count (the samples training would have consumed, with a shuffle buffer, packed
or not, across a resume); `--max-skip-fraction` stops a run that skips too much, saving first.

The datasets are written with webdataset's ShardWriter (PIL-drawn JPEGs and captions) and prepared with energon's
own `energon prepare`. A "bad" dataset and its "clean" twin hold the same keys in the same shards; the bad one has
truncated JPEG bytes at known keys. Both give the same stream of samples (the bad samples hold their slots in the
shuffle buffer), so the clean twin's stream says which bad samples training passed.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import read_metrics, run_mimo
from mimo.data import ByteTokenizer, FixedTiles, LaneLoader, MultimodalTaskEncoder
from mimo.core.telemetry.skip_report import SkipReporter
from mimo.data.skips import SkipRecord
from mimo.plugins import DataSource

NUM_SAMPLES, SHARD_SIZE = 24, 8
BAD = (2, 5, 11, 19)  # sample indices whose JPEG is cut short


def jpeg(index: int) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (24 + 4 * (index % 5), 32), (40 * (index % 6), 90, 200))
    ImageDraw.Draw(image).ellipse((4, 4, 20, 20), fill=(250, 250, 20))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


def write_dataset(root, bad=(), num_samples=NUM_SAMPLES, missing=(), shard_size=SHARD_SIZE) -> dict[str, str]:
    """{key: shard} of a captioning dataset written with ShardWriter, prepared with `energon prepare`; `bad`: JPEGs
    cut short; `missing`: samples without the caption the field map names."""
    import webdataset as wds
    from megatron.energon.tools.prepare import command as energon_prepare

    root.mkdir(parents=True)
    shards = {}
    with wds.ShardWriter(str(root / "part-%03d.tar"), maxcount=shard_size, verbose=0) as writer:
        for i in range(num_samples):
            key = f"img{i:04d}"
            data = jpeg(i)
            sample = {"__key__": key, "jpg": data[:len(data) // 2] if i in bad else data,
                      "txt": f"picture number {i}"}
            if i in missing:
                del sample["txt"]
            writer.write(sample)
            shards[key] = f"part-{i // shard_size:03d}.tar"
    energon_prepare.main([str(root), "--non-interactive", "--split-ratio", "1,0,0", "--sample-type",
                          "CaptioningSample", "--field-map", json.dumps({"image": "jpg", "caption": "txt"}),
                          "--no-progress"], standalone_mode=False)
    return shards


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("skips")
    shards = write_dataset(root / "clean")
    write_dataset(root / "bad", bad=BAD)
    return root / "clean", root / "bad", shards, {f"img{i:04d}" for i in BAD}


def encoder():
    return MultimodalTaskEncoder(ByteTokenizer(), seq_length=48, image_mode=FixedTiles(image_size=16, patch_size=8))


def consumed_rows(loader, micro_batches):
    """[(global worker, key)] of the samples `micro_batches` micro-batches consumed, and the records counted."""
    rows, records = [], []
    for _ in range(micro_batches):
        next(loader)
        rows += [(worker, key) for _, worker, _, key in loader.last_rows]
        records += loader.take_skip_records()
    return rows, records


def passed_bad_keys(clean_rows, rows, bad_keys) -> list[str]:
    """The bad samples the stream holds before the last good sample consumed. A lane's stream is its workers'
    samples in turn, a bad sample keeping its turn (as a tombstone), so the good samples consumed are the clean
    stream without the bad ones, and a bad sample counts once the loader has passed its place."""
    good = [row for row in clean_rows if row[1] not in bad_keys]
    assert rows == good[:len(rows)]  # the clean stream without the bad ones
    passed, taken = [], 0
    for _, key in clean_rows:  # up to the last good sample consumed (keys recur: the buffer spans epochs)
        if taken == len(rows):
            break
        if key in bad_keys:
            passed.append(key)
        else:
            taken += 1
    return passed


@pytest.mark.parametrize("num_workers, seed", [(0, 3), (2, 1)])  # seeds that meet bad samples before and after
def test_skip_count_is_exact_with_a_shuffle_buffer(datasets, num_workers, seed):
    """Counted: the bad samples training passed, not the ones the shuffle buffer read ahead; each record names
    its shard and key; a restore neither loses nor repeats one."""
    clean, bad, _, _ = datasets
    if num_workers == 0:
        check_skip_count(str(clean), str(bad), num_workers, seed)
    else:
        in_fresh_process("check_skip_count", str(clean), str(bad), num_workers, seed)


def in_fresh_process(function: str, *args):
    """This module's `function(*args)` in a fresh interpreter, its JSON result back. energon forks its loader
    workers from the process that reads: as in a training run, a fresh one, not pytest's, whose earlier tests
    leave threads behind (workers forked from it crashed in CI)."""
    paths = [str(Path(__file__).parent), str(Path(__file__).parents[1])]
    code = (f"import json, sys; sys.path[:0] = {paths!r}; import test_data_skips as module; "
            f"print(json.dumps(module.{function}(*json.loads({json.dumps(args)!r}))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def check_skip_count(clean: str, bad: str, num_workers: int, seed: int) -> None:
    shards = {f"img{i:04d}": f"part-{i // SHARD_SIZE:03d}.tar" for i in range(NUM_SAMPLES)}
    bad_keys = {f"img{i:04d}" for i in BAD}
    options = dict(micro_batch_size=2, num_lanes=1, num_workers=num_workers, seed=seed, shuffle_buffer_size=8)
    reference = LaneLoader(clean, encoder(), **options)
    clean_rows, _ = consumed_rows(reference, 20)
    reference.close()

    loader = LaneLoader(bad, encoder(), **options)
    rows, records = consumed_rows(loader, 3)  # 6 samples: fewer than the shuffle buffer's read-ahead
    expected = passed_bad_keys(clean_rows, rows, bad_keys)
    assert 0 < len(expected) < len(bad_keys)  # the buffer has read them all by now
    assert loader.skipped_samples == len(expected) == len(records)
    assert sorted(r.key for r in records) == sorted(expected)
    for record in records:
        assert record.shard == shards[record.key] and record.dataset == str(bad)
        assert record.error.startswith("file 'jpg' cannot be decoded") and "truncated" in record.error.lower()

    state = loader.state_dict()
    more_rows, more_records = consumed_rows(loader, 5)
    loader.close()
    expected_all = passed_bad_keys(clean_rows, rows + more_rows, bad_keys)
    assert len(expected_all) > len(expected) and loader.skipped_samples == len(expected_all)
    assert sorted(r.key for r in records + more_records) == sorted(expected_all)

    again = LaneLoader(bad, encoder(), **options)
    again.load_state_dict(state)
    assert again.skipped_samples == len(expected)
    again_rows, again_records = consumed_rows(again, 5)
    again.close()
    assert again_rows == more_rows and again.skipped_samples == len(expected_all)
    assert [(r.key, r.shard) for r in again_records] == [(r.key, r.shard) for r in more_records]


def test_a_sample_too_long_for_the_sequence_is_named_too(datasets):
    """The task encoder's own skips (no room for text after the image) name their shard and key as well."""
    in_fresh_process("check_too_long", str(datasets[0]))


def check_too_long(clean: str) -> None:
    shards = {f"img{i:04d}": f"part-{i // SHARD_SIZE:03d}.tar" for i in range(NUM_SAMPLES)}
    from mimo.data import DynamicResolution

    te = MultimodalTaskEncoder(ByteTokenizer(), seq_length=17,
                               image_mode=DynamicResolution(patch_size=8, min_patches=4, max_patches=64))
    loader = LaneLoader(clean, te, micro_batch_size=2, num_lanes=1, num_workers=1, seed=1, shuffle_buffer_size=None)
    _, records = consumed_rows(loader, 3)
    loader.close()
    assert records and loader.skipped_samples == len(records)
    for record in records:
        assert record.reason == "too_long" and record.shard == shards[record.key]
        assert record.describe().startswith(f"(too long for seq_length): dataset {clean}, shard "
                                            f"{shards[record.key]}, key {record.key}: needs ")
        assert "raise seq_length" in record.error


def test_skip_lines_are_rate_limited():
    now = [0.0]
    lines = []
    records = [SkipRecord(key=f"k{i}", reason="unreadable", error="file 'jpg' cannot be decoded", dataset="/d",
                          shard="s.tar") for i in range(12)]

    class Source(DataSource):
        def __next__(self):
            return {}

        def take_skip_records(self):
            taken, records[:] = list(records), []
            return taken

    reporter = SkipReporter(Source(), enabled=True, limit=5, window=60.0, clock=lambda: now[0], out=lines.append)
    reporter.report()
    assert len(lines) == 5 and lines[0] == ("skipped a sample (unreadable): dataset /d, shard s.tar, key k0: "
                                           "file 'jpg' cannot be decoded")
    now[0] = 61.0
    reporter.report()  # the window is over: the rest as one count
    assert lines[5] == "skipped 7 more samples in the last minute (not shown: at most 5 lines a minute)"
    records.append(SkipRecord(key="late", reason="too_long", error="", dataset="/d", shard="t.tar"))
    reporter.report()
    assert lines[6] == ("skipped a sample (too long for seq_length): dataset /d, shard t.tar, key late: too long "
                        "for seq_length")
    reporter.close()
    assert len(lines) == 7


def test_energon_prints_go_to_the_debug_log(datasets, caplog, capfd):
    """energon prints a line per failure in its error path (what still fails inside energon: here, read without the
    lane loader's tombstones); with the filter installed they reach the debug log only (in-process here, so that
    the log can be read; worker processes inherit the same filter)."""
    from mimo.data import get_multimodal_train_loader
    from mimo.data.energon_prints import route_energon_prints

    _, bad, _, _ = datasets
    route_energon_prints()
    loader, counter = get_multimodal_train_loader(bad, encoder(), batch_size=4, repeat=False)
    with caplog.at_level(logging.DEBUG, logger="mimo.data.energon"):
        rows = sum(b["input_ids"].shape[0] for b in loader)
    out, err = capfd.readouterr()
    assert rows == NUM_SAMPLES - len(BAD) and counter.count == len(BAD)
    assert "Except" not in out + err and "Traceback" not in out + err
    assert any("Except" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records][:3]


# --------------------------------------------------------------------------------------------------------------
# `mimo run --data`: the lines, the console, the count across a resume, the stop


def provider_stream(data, micro_batches, ctx_options):
    """[(worker, key)] mock-vlm's loader consumes in `micro_batches`, read in-process the way `mimo run` reads it."""
    from mimo.plugins import DataContext, Registry
    from mimo.plugins.settings import build_settings

    registry = Registry()
    settings = build_settings(registry.get("mock-vlm")[0], [])
    ctx = DataContext(num_microbatches=1, num_lanes=1, data_path=str(data), **ctx_options)
    loader = registry.hooks("mock-vlm").data_provider(settings=settings, ctx=ctx)
    rows, _ = consumed_rows(loader, micro_batches)
    loader.close()
    return rows


def skip_lines(stdout: str) -> dict[int, list[str]]:
    """{iteration: the keys its skip lines name} (the lines come before their iteration's log line)."""
    out, pending = {}, []
    for line in stdout.splitlines():
        if line.startswith("skipped a sample ("):
            pending.append(line.split(", key ")[1].split(":")[0])
        elif line.startswith("iteration "):
            out[int(line.split()[1].split("/")[0])] = pending
            pending = []
    return out


def run(tmp_path, name, data, *args):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--data", str(data), "--log-interval",
                      "1", "--metrics-file", str(metrics), "--micro-batch-size", "2", "--num-workers", "1", *args)
    return (read_metrics(metrics) if metrics.exists() else []), result


def test_mimo_run_names_each_skipped_sample_and_counts_exactly_across_a_resume(tmp_path, datasets):
    """Unpacked, so that consumed samples are stream positions (with packing a skip counts when the packing
    buffer, which reads ahead, passes it: docs/data.md)."""
    clean, bad, shards, bad_keys = datasets
    full, result = run(tmp_path, "full", bad, "--train-iters", "6", "--save", str(tmp_path / "save"),
                       "--save-interval", "3", "--seed", "5",  # a seed that meets bad samples both sides of 3
                       "--no-pack-sequences")
    assert result.returncode == 0, result.stderr[-3000:]
    console = result.stdout + result.stderr
    for noise in ("Except", "Traceback", "MapDataset", "ErrorContext"):  # energon's per-sample prints
        assert noise not in console
    stream = [tuple(row) for row in in_fresh_process("provider_stream", str(clean), 10,
                                                     {"micro_batch_size": 2, "seed": 5, "num_workers": 1})]
    good = [row for row in stream if row[1] not in bad_keys]
    expected = {n: passed_bad_keys(stream, good[:2 * n], bad_keys) for n in (3, 6)}  # 2 samples an iteration
    assert len(expected[3]) >= 1 and len(expected[6]) > len(expected[3])
    assert [r["skipped_samples"] for r in full if r["iteration"] in (3, 6)] == [len(expected[3]), len(expected[6])]
    named = skip_lines(result.stdout)
    assert sorted(k for n in (1, 2, 3) for k in named[n]) == sorted(expected[3])
    assert sorted(k for keys in named.values() for k in keys) == sorted(expected[6])
    for line in result.stdout.splitlines():
        if line.startswith("skipped a sample ("):
            key = line.split(", key ")[1].split(":")[0]
            assert line.startswith(f"skipped a sample (unreadable): dataset {bad}, shard {shards[key]}, key {key}: "
                                   f"file 'jpg' cannot be decoded (")

    resume = tmp_path / "resume"
    resume.mkdir()
    shutil.copytree(tmp_path / "save" / "iter_0000003", resume / "iter_0000003")
    (resume / "latest_checkpointed_iteration.txt").write_text("3")
    resumed, result = run(tmp_path, "resumed", bad, "--train-iters", "6", "--seed", "5", "--load", str(resume),
                          "--no-pack-sequences")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["skipped_samples"] for r in resumed] == [r["skipped_samples"] for r in full if r["iteration"] > 3]
    assert {n: keys for n, keys in skip_lines(result.stdout).items()} == {n: named[n] for n in (4, 5, 6)}


def test_max_skip_fraction_stops_the_run_in_one_line(tmp_path, datasets):
    _, bad, _, _ = datasets  # 4 of 24 samples bad
    records, result = run(tmp_path, "stopped", bad, "--train-iters", "30", "--micro-batch-size", "8",
                          "--max-skip-fraction", "0.05")
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "--max-skip-fraction 0.05" in errors[0], errors

    def over(record):
        read = record["samples"] + record["skipped_samples"]  # samples, not packed rows
        return read >= 100 and record["skipped_samples"] > 0.05 * read

    assert over(records[-1]) and not any(over(r) for r in records[:-1])  # stopped at the first iteration over
    skipped, read = records[-1]["skipped_samples"], records[-1]["samples"] + records[-1]["skipped_samples"]
    assert errors[0].startswith(f"error: {skipped} of the {read} samples read were skipped")
    assert errors[0].endswith("; nothing saved (no --save)")
    assert "Traceback" not in result.stdout + result.stderr
