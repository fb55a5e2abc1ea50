"""What --load means (Megatron's semantics, said aloud) and numeric options that must be finite."""

import math

import pytest

from helpers import read_metrics, run_mimo
from mimo.core.config import CheckpointOptions, OptimizerOptions, RunConfig
from mimo.core.checkpoint.resume import check_resume
from mimo.errors import UsageError

CPU = ("run", "--provider", "mock-vlm", "--device", "cpu", "--train-iters", "2", "--log-interval", "1")


def config(load, save=None):
    return RunConfig(provider="mock-vlm", checkpoint=CheckpointOptions(load=load, save=save))


def test_load_without_a_checkpoint_is_an_error_unless_it_is_the_save_directory(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match=r"--load .*/nowhere: no such directory; to start fresh, drop --load"):
        check_resume(config(tmp_path / "nowhere"))
    with pytest.raises(UsageError, match=r"--load .*/empty: no checkpoint there \(latest_checkpointed_iteration"):
        check_resume(config(empty, save=tmp_path / "elsewhere"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is a file, not a checkpoint directory"):
        check_resume(config(tmp_path / "file"))
    assert check_resume(config(empty, save=tmp_path / "." / "empty"), speak=False) is None
    one = tmp_path / "run" / "iter_0000002"
    one.mkdir(parents=True)
    (one / "common.pt").write_bytes(b"")
    with pytest.raises(UsageError, match=rf"^--load {one} is one checkpoint's folder; --load takes the --save "
                                         rf"directory that holds it \(--load {one.parent} resumes"):
        check_resume(config(one))
    assert capsys.readouterr().out == ""
    assert check_resume(config(empty, save=empty)) is None
    assert "holds no checkpoint yet" in capsys.readouterr().out
    (empty / "latest_checkpointed_iteration.txt").write_text("6\n")
    assert check_resume(config(empty, save=tmp_path / "other")) == 6
    assert check_resume(config(None)) is None


def test_a_save_directory_with_checkpoints_not_loaded_is_named(tmp_path, capsys):
    save = tmp_path / "save"
    save.mkdir()
    assert check_resume(config(None, save=save)) is None
    assert capsys.readouterr().out == ""  # nothing there yet: nothing to say
    (save / "latest_checkpointed_iteration.txt").write_text("150\n")
    cfg = config(None, save=save)
    cfg.checkpoint.keep_last = 3
    assert check_resume(cfg) is None
    assert capsys.readouterr().out.splitlines() == [
        f"warning: --save {save} already holds checkpoints (up to iteration 150) that this run does not load: its "
        f"saves replace them, and --keep-last deletes the older ones; to resume them, add --load {save}"]
    assert check_resume(config(None, save=save), speak=False) is None
    assert check_resume(config(save, save=tmp_path / "." / "save")) == 150  # resuming them: nothing to say
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("field", ["lr", "adam_eps", "clip_grad"])
def test_numeric_options_must_be_finite(field):
    for value in (math.nan, math.inf):
        cfg = RunConfig(provider="mock-vlm", optimizer=OptimizerOptions(**{field: value}))
        with pytest.raises(UsageError, match=f"--{field.replace('_', '-')} must be a finite number, got {value}"):
            cfg.validate()


def test_resume_lines_on_the_command_line(tmp_path):
    save, metrics = tmp_path / "save", tmp_path / "m.jsonl"
    # dropout: megatron-core's RNG tracker would log a warning per layer and step on the CPU; the console stays quiet
    fresh = run_mimo(*CPU, "--load", str(save), "--save", str(save), "--metrics-file", str(metrics),
                     "--set", "dropout=0.1")
    assert fresh.returncode == 0 and fresh.stderr == "", fresh.stderr[-3000:]
    assert f"--load {save} holds no checkpoint yet" in fresh.stdout.splitlines()[0]
    assert [r["iteration"] for r in read_metrics(metrics)] == [1, 2]
    typo = run_mimo(*CPU, "--load", str(tmp_path / "sav"), "--save", str(save))
    assert typo.returncode == 2 and typo.stderr.strip().splitlines() == [
        f"error: --load {tmp_path / 'sav'}: no such directory; to start fresh, drop --load or give it the --save "
        f"directory"]
    nan = run_mimo(*CPU, "--lr", "nan")
    assert nan.returncode == 2 and nan.stderr.strip().splitlines() == ["error: --lr must be a finite number, got nan"]
