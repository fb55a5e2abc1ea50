"""A damaged shard is skipped samples named by dataset and shard, or one line when the shard cannot be opened at
all; never a traceback.

The dataset is the skip tests' captioning dataset (3 shards of 8 samples); after `energon prepare` one shard is cut
short (`truncate`), another has one member's tar header checksum broken; or the first shard is gone (its index
stays: a copy that lost it), so it cannot be opened at all.
"""

from __future__ import annotations

import shutil
import tarfile

import pytest

from helpers import run_mimo
from test_data_skips import encoder, write_dataset
from mimo.data import LaneLoader


def break_header(shard, member: int) -> None:
    """Overwrite the checksum field of the tar header of the shard's `member`-th file."""
    with tarfile.open(shard) as tar:
        offset = tar.getmembers()[member].offset
    with open(shard, "r+b") as f:
        f.seek(offset + 148)  # the header's chksum field
        f.write(b"9999999\0")


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    write_dataset(root / "clean")
    shutil.copytree(root / "clean", root / "damaged")
    with open(root / "damaged" / "part-001.tar", "r+b") as f:
        f.truncate(20000)  # samples 3-7 of the shard are gone or cut
    break_header(root / "damaged" / "part-002.tar", 4)  # sample 2's jpg header
    shutil.copytree(root / "clean", root / "unopenable")
    (root / "unopenable" / "part-000.tar").unlink()
    return root


def test_a_damaged_shard_skips_its_samples_and_names_the_shard(damaged):
    """In-process: the cut-short and the broken-header shards' samples are counted as unreadable, each record
    naming the dataset and the shard; the intact shard's samples all train."""
    path = damaged / "damaged"
    loader = LaneLoader(path, encoder(), micro_batch_size=4, num_lanes=1, num_workers=0, shuffle_buffer_size=None,
                        max_samples_per_sequence=None)
    keys, records = [], []
    for _ in range(12):
        next(loader)
        keys += [key for *_, key in loader.last_rows]
        records += loader.take_skip_records()
    counts = loader.data_counts()
    assert counts.unreadable == len(records) > 0 and counts.samples == len(keys) == 48
    assert {r.shard for r in records} == {"part-001.tar", "part-002.tar"}
    assert all(r.dataset == str(path) and r.reason == "unreadable" and "shard is damaged" in r.error
               for r in records)
    assert {f"img{i:04d}" for i in range(8)} <= set(keys)  # the intact shard
    assert "img0018" not in keys  # the broken header's sample


def test_mimo_run_finishes_over_damaged_shards_without_a_traceback(damaged, tmp_path):
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--data", str(damaged / "damaged"),
                      "--train-iters", "12", "--log-interval", "4", env={"TORCH_COMPILE_DISABLE": "1"})
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "[rank0]" not in out
    assert f"skipped a sample (unreadable): dataset {damaged / 'damaged'}, shard part-001.tar" in out
    assert "samples skipped as unreadable" in out


def test_a_shard_that_cannot_be_opened_stops_the_run_in_one_line(damaged, tmp_path):
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--data", str(damaged / "unopenable"),
                      "--train-iters", "12", "--log-interval", "4", env={"TORCH_COMPILE_DISABLE": "1"})
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "[rank0]" not in out
    [line] = [line for line in out.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: --data {damaged / 'unopenable'}: shard part-000.tar: the shard cannot be "
                           f"opened (FileNotFoundError: ")
    assert "energon prepare" in line
