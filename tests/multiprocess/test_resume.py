"""What --load means (Megatron's semantics, said aloud) and numeric options that must be finite."""

import math

import torch

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


def test_a_save_directory_with_checkpoints_not_loaded_is_refused(tmp_path, capsys):
    save = tmp_path / "save"
    save.mkdir()
    assert check_resume(config(None, save=save)) is None
    assert capsys.readouterr().out == ""  # nothing there yet: nothing to say
    (save / "iter_0000150").mkdir()
    torch.save({"series": "a"}, save / "iter_0000150" / "common.pt")
    (save / "latest_checkpointed_iteration.txt").write_text("150\n")
    with pytest.raises(UsageError, match=rf"^--save {save} already holds checkpoints \(iter_0000150\) that this run "
                                         rf"does not load: add --load {save} to resume them \(at iteration 150\), or "
                                         rf"--start-anew to start a new run there that keeps them where they are$"):
        check_resume(config(None, save=save))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "latest_checkpointed_iteration.txt").write_text("3\n")
    with pytest.raises(UsageError, match="already holds checkpoints"):  # resuming another folder into it
        check_resume(config(tmp_path / "other", save=save))
    assert check_resume(config(save, save=tmp_path / "." / "save")) == 150  # resuming them: nothing to say
    assert capsys.readouterr().out == ""
    anew = config(None, save=save)
    anew.checkpoint.start_anew = True
    assert check_resume(anew, train_iters=100) is None
    assert "also holds 1 complete checkpoint of another run (iter_0000150): kept where they are" in \
        capsys.readouterr().out
    with pytest.raises(UsageError, match=rf"this run would save iteration 150 where {save} holds another run's "
                                         rf"complete checkpoint \(iter_0000150\), which a run never replaces"):
        check_resume(anew, train_iters=150)  # its one save, at the end
    anew.checkpoint.save_interval = 50
    with pytest.raises(UsageError, match="would save iteration 150 where"):
        check_resume(anew, train_iters=200)
    anew.checkpoint.load = save
    with pytest.raises(UsageError, match="--start-anew starts without the checkpoints in --save"):
        check_resume(anew)


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
