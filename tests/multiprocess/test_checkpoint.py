"""Checkpoints: exact resume (colocated and heterogeneous), crash safety, resharding, constant structure, errors."""

import shutil

import pytest

from helpers import read_metrics, run_mimo

BASE = ("run", "--provider", "mock-vlm", "--device", "cpu", "--log-interval", "1", "--set", "image_probability=0.5")
HETERO = ("--nproc-per-node", "2", "--encoder-ranks", "1")


def train(tmp_path, name, *args, env=None, ok=True):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_mimo(*BASE, "--metrics-file", str(metrics), *args, env=env)
    if ok:
        assert result.returncode == 0, result.stderr[-3000:]
    return (read_metrics(metrics) if metrics.exists() else []), result


def losses(records):
    return {r["iteration"]: r["lm_loss"] for r in records}


def only_checkpoint(save_dir, iteration, into):
    """A save directory holding just one checkpoint (as if the run had stopped right after it)."""
    into.mkdir()
    shutil.copytree(save_dir / f"iter_{iteration:07d}", into / f"iter_{iteration:07d}")
    (into / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    return into


@pytest.mark.parametrize("layout", [pytest.param((), marks=pytest.mark.smoke), HETERO],
                         ids=["colocated", "heterogeneous"])
def test_resume_matches_an_uninterrupted_run_bit_for_bit(tmp_path, layout):
    save = tmp_path / "save"
    full, _ = train(tmp_path, "full", "--train-iters", "12", "--save", str(save), "--save-interval", "6", *layout)
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "12\n"
    files = {p.name for p in (save / "iter_0000006").iterdir()}
    assert {"common.pt", "metadata.json", ".metadata"} <= files and any(f.endswith(".distcp") for f in files)
    resume_dir = only_checkpoint(save, 6, tmp_path / "from6")
    resumed, result = train(tmp_path, "resumed", "--train-iters", "12", "--load", str(resume_dir), *layout)
    assert "resumed from" in result.stdout and [r["iteration"] for r in resumed] == list(range(7, 13))
    assert losses(resumed) == {i: loss for i, loss in losses(full).items() if i > 6}  # exact equality
    assert resumed[-1]["consumed_samples"] == full[-1]["consumed_samples"]


def test_distributed_optimizer_resume_matches_an_uninterrupted_run_bit_for_bit(tmp_path):
    # The default (dp_reshardable) state: its loader once copied the fresh optimizer's Adam step (1) over the
    # saved one, so iteration 4, the first update after the resume, differed.
    save, common = tmp_path / "save", ("--train-iters", "4", "--nproc-per-node", "2", "--use-distributed-optimizer")
    full, _ = train(tmp_path, "full", *common, "--save", str(save), "--save-interval", "2")
    resumed, _ = train(tmp_path, "resumed", *common, "--load", str(only_checkpoint(save, 2, tmp_path / "from2")))
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert losses(resumed) == {i: loss for i, loss in losses(full).items() if i > 2}  # exact equality


@pytest.mark.parametrize("stage", ["before-shards", "after-shards", "before-tracker"])
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, stage):
    save = tmp_path / "save"
    _, killed = train(tmp_path, "killed", "--train-iters", "6", "--save", str(save), "--save-interval", "2",
                      env={"MIMO_FAULT_KILL_AT": f"{stage}@4"}, ok=False)
    assert killed.returncode == -9  # SIGKILL, mid-save
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    resumed, result = train(tmp_path, "resumed", "--train-iters", "6", "--save", str(save), "--load", str(save),
                            "--save-interval", "2")
    if stage == "before-tracker":  # iteration 4 was complete (its common.pt written): the tracker moves up to it
        assert "the tracker named iteration 2, but iter_0000004 is complete" in result.stdout
        assert [r["iteration"] for r in resumed] == [5, 6]
    else:  # cut short: its folder is removed, saying so, and iteration 2 resumes
        assert f"removed 1 unfinished checkpoint in {save} (iter_0000004: " in result.stdout
        assert [r["iteration"] for r in resumed] == [3, 4, 5, 6]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "6\n"
    assert all((p / "common.pt").is_file() for p in save.glob("iter_*"))  # no half-written iteration left


def test_resume_at_another_data_parallel_size_with_a_fully_reshardable_optimizer(tmp_path):
    save = tmp_path / "save"
    common = ("--train-iters", "6", "--global-batch-size", "8", "--micro-batch-size", "2",
              "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable")
    full, _ = train(tmp_path, "dp2", *common, "--nproc-per-node", "2", "--save", str(save), "--save-interval", "3")
    from3 = only_checkpoint(save, 3, tmp_path / "from3")
    resumed, _ = train(tmp_path, "dp1", *common, "--load", str(from3))
    for iteration, loss in losses(resumed).items():
        assert loss == pytest.approx(losses(full)[iteration], rel=1e-6), iteration


def test_dp_sharded_optimizer_state_refuses_another_dp_size(tmp_path):
    save = tmp_path / "save"
    common = ("--train-iters", "2", "--global-batch-size", "8", "--micro-batch-size", "2",
              "--use-distributed-optimizer")
    train(tmp_path, "dp2", *common, "--nproc-per-node", "2", "--save", str(save))
    _, result = train(tmp_path, "dp1", *common, "--load", str(save), ok=False)
    assert result.returncode == 2
    assert "distributed-optimizer state is sharded for images DP 2, this run has DP 1" in result.stderr


def test_constant_structure_saves_twice_and_the_later_checkpoint_loads(tmp_path):
    save = tmp_path / "save"
    full, _ = train(tmp_path, "full", "--train-iters", "6", "--save", str(save), "--save-interval", "2",
                    "--ckpt-assume-constant-structure", *HETERO)
    from4 = only_checkpoint(save, 4, tmp_path / "from4")
    resumed, _ = train(tmp_path, "resumed", "--train-iters", "6", "--load", str(from4),
                       "--ckpt-assume-constant-structure", *HETERO)
    assert losses(resumed) == {i: loss for i, loss in losses(full).items() if i > 4}


def test_async_save_keep_last_and_inspect(tmp_path):
    save = tmp_path / "save"
    _, result = train(tmp_path, "async", "--train-iters", "4", "--save", str(save), "--save-interval", "1",
                      "--async-save", "--keep-last", "2")
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000003", "iter_0000004"]
    reports = [line for line in result.stdout.splitlines() if line.startswith("saved checkpoint")]
    assert len(reports) == 4 and all(", training blocked " in line for line in reports)
    inspected = run_mimo("ckpt", "inspect", str(save), "--json")
    assert inspected.returncode == 0, inspected.stderr
    import json
    summary = json.loads(inspected.stdout)
    assert summary["iteration"] == 4 and summary["provider"] == "mock-vlm" and summary["consumed_samples"] == 16
    assert summary["parameters"] == {"images": 121792, "language": 133376} and summary["contents"]["optimizer"]


def test_weights_only_checkpoint_warns_and_starts_a_fresh_optimizer(tmp_path):
    save = tmp_path / "save"
    train(tmp_path, "a", "--train-iters", "2", "--save", str(save), "--no-save-optim")
    resumed, result = train(tmp_path, "b", "--train-iters", "3", "--load", str(save), "--no-load-scheduler")
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "no optimizer state" in warnings[0] and [r["iteration"] for r in resumed] == [3]


@pytest.mark.smoke
def test_finetune_and_pretrained_start_from_the_weights_at_iteration_zero(tmp_path):
    save = tmp_path / "save"
    trained, _ = train(tmp_path, "a", "--train-iters", "8", "--save", str(save))
    fresh, _ = train(tmp_path, "fresh", "--train-iters", "1")
    tuned, _ = train(tmp_path, "ft", "--train-iters", "1", "--load", str(save), "--finetune")
    pretrained, _ = train(tmp_path, "pt", "--train-iters", "1", "--pretrained", str(save),
                          "--load", str(tmp_path / "empty"), "--save", str(tmp_path / "empty"))
    assert tuned[0]["iteration"] == 1 and tuned[0]["consumed_samples"] == 4
    # Same first batch as the fresh run, but the trained weights: a lower loss, the same for both ways in.
    assert tuned[0]["lm_loss"] < fresh[0]["lm_loss"] - 0.3
    assert pretrained[0]["lm_loss"] == tuned[0]["lm_loss"]


def test_bf16_weights_loaded_without_optimizer_state_survive_the_first_step(tmp_path):
    # bf16 optimizers step fp32 main copies of the weights; taken before the load, they once put the initial
    # weights back at the first step (the second loss rose above the fresh run's).
    save = tmp_path / "save"
    train(tmp_path, "a", "--train-iters", "8", "--precision", "bf16", "--save", str(save))
    fresh, _ = train(tmp_path, "fresh", "--train-iters", "2", "--precision", "bf16")
    for optimizer in ((), ("--use-distributed-optimizer",)):
        tuned, _ = train(tmp_path, f"ft{len(optimizer)}", "--train-iters", "2", "--precision", "bf16",
                         "--load", str(save), "--finetune", *optimizer)
        assert tuned[1]["lm_loss"] < fresh[1]["lm_loss"] - 0.3, optimizer


@pytest.mark.smoke
def test_broken_checkpoints_are_one_clear_line(tmp_path):
    save = tmp_path / "save"
    train(tmp_path, "a", "--train-iters", "2", "--save", str(save))
    shard = next((save / "iter_0000002").glob("*.distcp"))

    def load_error():
        result = run_mimo(*BASE, "--train-iters", "3", "--load", str(save))
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
        return result.stderr

    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated
    assert f"checkpoint file {shard} is truncated" in load_error()
    shard.write_bytes(data[:100] + bytes(len(data) - 100))  # same size, garbage after the header
    assert f"checkpoint file {shard} is damaged (its CRC32 differs from the one saved)" in load_error()
    sums = (save / "iter_0000002" / "checksums.json").read_bytes()
    (save / "iter_0000002" / "checksums.json").unlink()  # as an older mimo saved it: the load itself fails
    assert "iter_0000002 cannot be loaded" in load_error()
    (save / "iter_0000002" / "checksums.json").write_bytes(sums)
    shard.write_bytes(data)
    (save / "latest_checkpointed_iteration.txt").write_text("garbage")
    assert "latest_checkpointed_iteration.txt is corrupted" in load_error()
    (save / "latest_checkpointed_iteration.txt").write_text("7\n")
    assert "names iteration 7, but" in load_error() and "iter_0000007 is missing" in load_error()
    (save / "latest_checkpointed_iteration.txt").write_text("2\n")
    (save / "iter_0000002" / "common.pt").unlink()
    assert "common.pt is missing" in load_error()
