"""megatron-energon data in training: the lane loader (routing, state, skips), `mimo data sample`, `mimo run --data`."""

from __future__ import annotations

import pickle
import time
import shutil

import pytest
import torch
from typer.testing import CliRunner

from helpers import read_metrics, run_mimo
from mimo.cli.data import data_app
from mimo.core.parallel import topology
from mimo.data import (
    ByteTokenizer, FixedTiles, LaneLoader, MultimodalTaskEncoder, merge_lane_batches, prepare_energon_dataset,
    write_sample_dataset,
)
from mimo.errors import UsageError
from mimo.plugins import DataContext, ModuleParallelism

IMAGE, PATCH = 16, 8


def encoder():
    return MultimodalTaskEncoder(ByteTokenizer(), seq_length=64,
                                 image_mode=FixedTiles(image_size=IMAGE, patch_size=PATCH))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_sample_dataset(tmp_path_factory.mktemp("ds") / "captions", num_samples=48, seed=2, shard_size=8)


def images_of(batch) -> torch.Tensor:
    return batch["modality_inputs"]["images"]["vit"]["x"]


def keys(loader) -> list[str]:
    return [row[3] for row in loader.last_rows]


def read(loader, count):
    """`count` micro-batches and the sample keys of their rows."""
    out = []
    for _ in range(count):
        batch = next(loader)
        out.append((batch, keys(loader)))
    return out


# --------------------------------------------------------------------------------------------------------------
# role-aware loading: every rank of a layout reads the same samples in the same order


def layout_contexts(encoder_dp, llm_dp, micro_batch_size, num_workers, path, seed=11):
    """{rank: DataContext} the way core/run/world.py builds them from core/parallel/topology.data_positions."""
    parallelism = {"images": ModuleParallelism(0, encoder_dp), "language": ModuleParallelism(encoder_dp, llm_dp)}
    contexts = {}
    for rank in range(encoder_dp + llm_dp):
        first, count = topology.data_positions(parallelism, rank, micro_batch_size)
        contexts[rank] = DataContext(micro_batch_size=micro_batch_size, num_microbatches=2, num_lanes=llm_dp,
                                     seed=seed, first_position=first, num_positions=count,
                                     data_path=str(path), num_workers=num_workers)
    return contexts


@pytest.mark.parametrize("encoder_dp, llm_dp, num_workers", [
    (1, 2, 0), (1, 2, 2), (1, 4, 1), (2, 4, 1),  # fan-out: one loader per encoder rank feeds 2 or 4 lanes
    (2, 1, 2), (4, 2, 0),  # fan-in: encoder ranks take their part of one lane's micro-batch
    (2, 2, 1),  # one encoder rank per lane
])
def test_encoder_ranks_and_llm_lanes_see_the_same_samples(dataset, encoder_dp, llm_dp, num_workers):
    micro_batch_size, steps = 2, 3
    contexts = layout_contexts(encoder_dp, llm_dp, micro_batch_size, num_workers, dataset.path)
    seen = {}
    for rank, ctx in contexts.items():
        loader = LaneLoader.from_context(ctx, encoder())
        seen[rank] = read(loader, steps)
        loader.close()
    llm_ranks = range(encoder_dp, encoder_dp + llm_dp)
    for m in range(steps):
        # all lanes' m-th micro-batches side by side: the positions every rank reads a slice of
        row_keys = [k for r in llm_ranks for k in seen[r][m][1]]
        images = torch.cat([images_of(seen[r][m][0]) for r in llm_ranks])
        input_ids = torch.cat([seen[r][m][0]["input_ids"] for r in llm_ranks])
        assert len(set(row_keys)) > 1
        for rank in range(encoder_dp):
            first, count = contexts[rank].first_position, contexts[rank].num_positions
            batch, got = seen[rank][m]
            assert got == row_keys[first:first + count], (rank, m)
            # the merged (or split) encoder input is exactly those rows' images, in row order
            assert torch.equal(images_of(batch), images[first:first + count])
            assert torch.equal(batch["input_ids"], input_ids[first:first + count])


def test_one_loader_for_several_lanes_matches_a_loader_per_lane(dataset):
    """The routing itself: a 2-lane loader with 2 x 3 workers gives each lane the stream of its own loader."""
    merged = LaneLoader(dataset.path, encoder(), micro_batch_size=3, num_lanes=2, num_workers=3, seed=5)
    together = read(merged, 4)
    merged.close()
    for lane in range(2):
        alone = LaneLoader(dataset.path, encoder(), micro_batch_size=3, num_lanes=2, lanes=range(lane, lane + 1),
                           num_workers=3, seed=5)
        assert [k for _, k in read(alone, 4)] == [k[3 * lane:3 * lane + 3] for _, k in together]
        alone.close()


def test_merging_lane_micro_batches_follows_the_schema():
    te = encoder()
    from megatron.energon import CaptioningSample

    samples = [te.encode_sample(CaptioningSample(__key__=f"s{i}", __restore_key__=(), image=torch.rand(3, 20, 30),
                                                 caption="ab" * (i + 1))) for i in range(3)]
    whole = te.batch(samples)
    merged = merge_lane_batches([te.batch(samples[:1]), te.batch(samples[1:])])
    for key in ("input_ids", "labels", "loss_mask", "position_ids"):
        assert torch.equal(merged[key], whole[key]), key
    assert torch.equal(images_of(merged), images_of(whole))
    # lanes padded to their own longest row: narrower rows are padded with zeros (no loss, no placeholder)
    short = MultimodalTaskEncoder(ByteTokenizer(), seq_length=64, pad_to_longest=True,
                                  image_mode=FixedTiles(image_size=IMAGE, patch_size=PATCH))
    a, b = short.batch(samples[:1]), short.batch(samples[2:])
    mixed = merge_lane_batches([a, b])
    assert mixed["input_ids"].shape == (2, b["input_ids"].shape[1]) > a["input_ids"].shape
    assert float(mixed["loss_mask"][0, a["input_ids"].shape[1]:].sum()) == 0.0
    with pytest.raises(TypeError, match="pixel_mask"):
        merge_lane_batches([{**a, "pixel_mask": torch.ones(1)}, b])


# --------------------------------------------------------------------------------------------------------------
# resumable: a restored loader continues the exact stream


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_loader_reading_ahead_saves_and_counts_as_of_what_was_consumed(dataset, num_workers):
    def loader(ahead=0):
        return LaneLoader(dataset.path, encoder(), micro_batch_size=2, num_lanes=1, num_workers=num_workers, seed=6,
                          read_ahead=ahead)

    plain, ahead = loader(), loader(3)
    assert [k for _, k in read(plain, 3)] == [k for _, k in read(ahead, 3)]
    deadline = time.time() + 30
    while ahead._ahead._queue.qsize() < 3 and time.time() < deadline:  # its thread has made three more
        time.sleep(0.05)
    assert ahead._ahead._queue.qsize() == 3
    assert ahead.data_counts() == plain.data_counts() and ahead.micro_batches == plain.micro_batches == 3
    state = pickle.loads(pickle.dumps(ahead.state_dict()))
    assert state["micro_batches"] == 3 and state["lanes"][0]["counts"] == plain.state_dict()["lanes"][0]["counts"]
    expected = read(ahead, 4)
    assert [k for _, k in expected] == [k for _, k in read(plain, 4)]
    ahead.close()
    plain.close()
    again = loader()
    again.load_state_dict(state)
    for (batch, k), (want, want_keys) in zip(read(again, 4), expected):
        assert k == want_keys and torch.equal(batch["input_ids"], want["input_ids"])
    again.close()


@pytest.mark.parametrize("num_workers", [0, 1])
def test_restored_loader_continues_the_exact_stream(dataset, num_workers):
    def loader(lanes=range(0, 2)):
        return LaneLoader(dataset.path, encoder(), micro_batch_size=2, num_lanes=2, lanes=lanes,
                          num_workers=num_workers, seed=3)

    first = loader()
    read(first, 3)
    state = pickle.loads(pickle.dumps(first.state_dict()))  # what a checkpoint stores: plain data and bytes
    expected = read(first, 4)
    first.close()
    again = loader()
    again.load_state_dict(state)
    for (batch, k), (want, want_keys) in zip(read(again, 4), expected):
        assert k == want_keys
        for key in ("input_ids", "labels", "loss_mask"):
            assert torch.equal(batch[key], want[key])
        assert torch.equal(images_of(batch), images_of(want))
    again.close()
    # a lane's state is the same whichever loader read it: two one-lane loaders' states restore a two-lane loader
    lanes = []
    for lane in range(2):
        alone = loader(range(lane, lane + 1))
        read(alone, 3)
        lanes.append(alone.state_dict())
        alone.close()
    both = loader()
    both.load_state_dict({**lanes[0], "lanes": {0: lanes[0]["lanes"][0], 1: lanes[1]["lanes"][1]}})
    assert [k for _, k in read(both, 4)] == [k for _, k in expected]
    both.close()


def test_state_of_workers_that_have_not_yielded_since_a_restore(dataset):
    """One sample per micro-batch and three workers: after a restore, saving before every worker has yielded again
    still gives the right state (energon 7.4.1 alone would put those workers back to their internal checkpoint,
    which lies before their position once they have yielded twice)."""
    def loader():
        return LaneLoader(dataset.path, encoder(), micro_batch_size=1, num_lanes=1, num_workers=3, seed=9)

    reference = loader()
    stream = [k for _, k in read(reference, 14)]
    reference.close()
    a = loader()
    read(a, 7)  # the workers yielded 3, 2 and 2 samples
    state = a.state_dict()
    a.close()
    b = loader()
    b.load_state_dict(state)
    assert b.state_dict() is state  # restored and not read since: nothing changed
    assert [k for _, k in read(b, 1)] == stream[7:8]
    state = b.state_dict()  # two of three workers have not yielded since the restore
    b.close()
    c = loader()
    c.load_state_dict(state)
    assert [k for _, k in read(c, 6)] == stream[8:14]
    c.close()


def test_without_a_state_a_rank_rereads_up_to_the_consumed_samples(dataset):
    """An encoder rank gets no data state from a checkpoint: from `start_sample` it re-reads to the same place."""
    lanes = LaneLoader(dataset.path, encoder(), micro_batch_size=2, num_lanes=2, num_workers=1, seed=4)
    read(lanes, 3)
    expected = [k for _, k in read(lanes, 2)]
    lanes.close()
    late = LaneLoader(dataset.path, encoder(), micro_batch_size=2, num_lanes=2, num_workers=1, seed=4,
                      start_sample=3 * 2 * 2)
    assert [k for _, k in read(late, 2)] == expected and late.micro_batches == 5
    late.close()


def test_refuses_a_state_from_another_worker_count(dataset):
    saved = LaneLoader(dataset.path, encoder(), micro_batch_size=2, num_lanes=1, num_workers=0).state_dict()
    other = LaneLoader(dataset.path, encoder(), micro_batch_size=2, num_lanes=1, num_workers=1)
    with pytest.raises(UsageError, match="--num-workers 0"):
        other.load_state_dict(saved)


# --------------------------------------------------------------------------------------------------------------
# bad data


def skips_after_each(loader, count) -> list[int]:
    out = []
    for _ in range(count):
        next(loader)
        out.append(loader.skipped_samples)
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skips_are_counted_where_the_consumed_stream_passes_them(tmp_path, num_workers):
    """A corrupt twin of a clean dataset (same keys, same order): the loader yields the clean stream without the
    corrupt samples, and counts exactly the corrupt reads the stream (its workers in turn) passed before the last sample it yielded."""
    common = dict(num_samples=24, seed=1, shard_size=6)
    clean = write_sample_dataset(tmp_path / "clean", **common)
    bad = write_sample_dataset(tmp_path / "bad", corrupt_indices=[3, 14], **common)
    options = dict(micro_batch_size=2, num_lanes=1, num_workers=num_workers, seed=6, shuffle_buffer_size=None)
    reference = LaneLoader(clean.path, encoder(), **options)
    clean_rows = []
    for _ in range(30):
        next(reference)
        clean_rows += [(worker, key) for _, worker, _, key in reference.last_rows]
    reference.close()
    loader = LaneLoader(bad.path, encoder(), **options)
    rows = []
    for _ in range(20):
        next(loader)
        rows += [(worker, key) for _, worker, _, key in loader.last_rows]
    expected, taken = 0, 0
    good = [row for row in clean_rows if row[1] not in bad.corrupt_keys]
    assert rows == good[:len(rows)]  # the clean stream without the corrupt samples (which keep their turn)
    for _, key in clean_rows:  # the corrupt reads before the last consumed sample
        if taken == len(rows):
            break
        if key in bad.corrupt_keys:
            expected += 1
        else:
            taken += 1
    assert expected >= 2 and loader.skipped_samples == expected
    # the count survives a restore, without counting what the restored workers re-read
    state = loader.state_dict()
    more = skips_after_each(loader, 6)
    loader.close()
    again = LaneLoader(bad.path, encoder(), **options)
    again.load_state_dict(state)
    assert again.skipped_samples == expected and skips_after_each(again, 6) == more
    again.close()


def test_bad_dataset_paths_are_one_clear_line(tmp_path, dataset):
    te = encoder()
    with pytest.raises(UsageError, match="no such dataset"):
        LaneLoader(tmp_path / "missing", te, micro_batch_size=2, num_lanes=1)
    (tmp_path / "plain").mkdir()
    with pytest.raises(UsageError, match="not an energon dataset"):
        LaneLoader(tmp_path / "plain", te, micro_batch_size=2, num_lanes=1)
    info = write_sample_dataset(tmp_path / "no_train", num_samples=4, shard_size=4, prepare=False)
    prepare_energon_dataset(info.path, info.shards, split_parts_patterns=[("train", "^$"), ("val", ".*")])
    with pytest.raises(UsageError, match="no training samples"):
        LaneLoader(info.path, te, micro_batch_size=2, num_lanes=1)
    with pytest.raises(UsageError, match=r"^the eval data .*: the dataset has no val samples .*: hold some samples "
                                         r"out for it when making the dataset \(mimo data convert llava "
                                         r"--val-fraction F, .*; docs/evaluation.md\)$"):
        LaneLoader(dataset.path, te, micro_batch_size=2, num_lanes=1, split_part="val")
    with pytest.raises(UsageError, match="lower --num-workers"):
        LaneLoader(dataset.path, te, micro_batch_size=2, num_lanes=4, lanes=range(0, 1), num_workers=16)
    broken = write_sample_dataset(tmp_path / "broken", num_samples=4, shard_size=4, corrupt_indices=range(4))
    for workers in (0, 1):
        loader = LaneLoader(broken.path, te, micro_batch_size=2, num_lanes=1, num_workers=workers)
        with pytest.raises(UsageError, match="the last 100 samples read were all skipped"):
            next(loader)
        loader.close()


def test_mock_vlm_needs_a_vocabulary_for_byte_captions(dataset):
    from mimo.providers.mock_vlm import MockVLMSettings
    from mimo.providers.mock_vlm.data import energon_batches

    ctx = DataContext(micro_batch_size=2, num_microbatches=1, num_lanes=1, seed=1, data_path=str(dataset.path))
    with pytest.raises(UsageError, match="--set vocab_size=260"):
        energon_batches(MockVLMSettings(vocab_size=256), ctx)
    loader = energon_batches(MockVLMSettings(vocab_size=300, image_size=16), ctx)
    batch = next(loader)
    assert int((batch["input_ids"] == 299).sum()) == 2 * 4  # mock-vlm's placeholder, 4 patches per image
    assert int(batch["input_ids"].max()) == 299 and images_of(batch).shape == (2, 3, 16, 16)
    loader.close()


# --------------------------------------------------------------------------------------------------------------
# the CLI: `mimo data sample`, `mimo run --data`


def test_data_sample_command(tmp_path):
    runner = CliRunner()
    result = runner.invoke(data_app, ["sample", str(tmp_path / "ds"), "--num-samples", "12", "--corrupt", "2",
                                      "--seed", "4"])
    assert result.exit_code == 0, result.output
    assert "wrote 12 samples in 1 shard " in result.output and "2 corrupt" in result.output
    assert (tmp_path / "ds" / ".nv-meta" / "dataset.yaml").is_file()
    result = runner.invoke(data_app, ["sample", str(tmp_path / "ds")])
    assert result.exit_code == 2 and "is not empty" in result.output
    result = runner.invoke(data_app, ["sample", str(tmp_path / "x"), "--num-samples", "3", "--corrupt", "4"])
    assert result.exit_code == 2 and "--corrupt 4" in result.output
    (tmp_path / "a_file").write_text("x")  # was a NotADirectoryError traceback
    result = runner.invoke(data_app, ["sample", str(tmp_path / "a_file")])
    assert result.exit_code == 2 and "a_file is a file: choose a new directory" in result.output


def train(tmp_path, name, *args, ok=True):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--log-interval", "1",
                      "--metrics-file", str(metrics), *args)
    if ok:
        assert result.returncode == 0, result.stderr[-3000:]
    return (read_metrics(metrics) if metrics.exists() else []), result


@pytest.mark.smoke
def test_mock_vlm_trains_on_a_sample_dataset(tmp_path):
    assert CliRunner().invoke(data_app, ["sample", str(tmp_path / "ds"), "--num-samples", "32"]).exit_code == 0
    records, result = train(tmp_path, "run", "--data", str(tmp_path / "ds"), "--train-iters", "10")
    losses = [r["lm_loss"] for r in records]
    assert len(losses) == 10 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert "skipped samples" not in result.stdout


@pytest.mark.smoke
def test_a_corrupt_image_is_skipped_and_reported(tmp_path):
    # one shard read in order (no shuffle buffer, no packing): the corrupt sample is met once in the 40 samples
    # trained
    info = write_sample_dataset(tmp_path / "ds", num_samples=48, seed=3, shard_size=48, corrupt_indices=[10])
    records, result = train(tmp_path, "run", "--data", str(info.path), "--train-iters", "10",
                            "--set", "shuffle_buffer=0", "--num-workers", "2", "--no-pack-sequences")
    assert [r["iteration"] for r in records] == list(range(1, 11))
    assert records[-1]["skipped_samples"] == 1
    last_interval = [line for line in result.stdout.splitlines() if line.startswith("iteration")][-1]
    assert "skipped samples 1 unreadable" in last_interval
    assert "  data: 1 sample skipped as unreadable" in result.stdout.splitlines()  # the closing summary


@pytest.mark.smoke
@pytest.mark.parametrize("packing", [
    # sequences of 160 tokens hold two of these samples: 8 per iteration, 24 of the 48 at the save
    ("--set", "seq_length=160", "--packing-buffer-size", "16"),
    ("--no-pack-sequences",),
], ids=["packed", "unpacked"])
def test_resume_with_data_matches_an_uninterrupted_run(tmp_path, dataset, packing):
    """Heterogeneous, resumed in the middle of an epoch: the LLM rank restores its lane's loader state (with
    packing, energon's packing buffer too) from the checkpoint; the encoder rank, which the checkpoint holds no
    data state for, re-reads the lane up to the consumed samples."""
    common = ("--data", str(dataset.path), "--train-iters", "6", "--num-workers", "1", "--nproc-per-node", "2",
              "--encoder-ranks", "1", *packing)
    full, _ = train(tmp_path, "full", *common, "--save", str(tmp_path / "save"), "--save-interval", "3")
    resume = tmp_path / "from3"
    resume.mkdir()
    shutil.copytree(tmp_path / "save" / "iter_0000003", resume / "iter_0000003")
    (resume / "latest_checkpointed_iteration.txt").write_text("3\n")
    resumed, result = train(tmp_path, "resumed", *common, "--load", str(resume))
    assert "resumed from" in result.stdout
    assert {r["iteration"]: r["lm_loss"] for r in resumed} == {r["iteration"]: r["lm_loss"] for r in full
                                                               if r["iteration"] > 3}


def test_an_encoder_rank_feeding_two_lanes_trains_like_colocated_ranks(tmp_path, dataset):
    """Same LLM lanes, so the same samples: the encoder rank's merged micro-batches give the same run (the
    in-process sweep above checks fan-in's split micro-batches sample by sample)."""
    common = ("--data", str(dataset.path), "--train-iters", "3", "--num-workers", "1", "--micro-batch-size", "2",
              "--global-batch-size", "8", "--seed", "3")
    want, _ = train(tmp_path, "colocated", *common, "--nproc-per-node", "2")
    got, _ = train(tmp_path, "heterogeneous", *common, "--nproc-per-node", "3", "--encoder-ranks", "1")
    assert len(got) == len(want) == 3
    for a, b in zip(want, got):
        for key in ("lm_loss", "grad_norm_images", "grad_norm_language"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["iteration"], key)
