"""Two Ctrl-C while a checkpoint is being written: one line says the save is finishing, the run stops once it is
written (saved, exit 1), no traceback, no megatron-core ERROR lines, and the checkpoint directory is consistent
(the tracker names the last complete checkpoint; no half-written iter_*)."""

import os
import signal
import sys
import time

from helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
from fault_battery import BASE, Run, tracked  # noqa: E402

# A mock-vlm large enough (about 0.6 GB of weights and optimizer state) that writing it takes seconds on the CPU.
LARGE = ("--set", "hidden_size=1024", "--set", "num_layers=6")


def writing(save, iteration: int) -> bool:
    """Whether the checkpoint of `iteration` is being written: its folder exists, its checksums (the last file
    before the tracker) do not yet."""
    folder = save / f"iter_{iteration:07d}"
    return folder.is_dir() and not (folder / "checksums.json").exists()


def test_two_ctrl_c_during_a_save_finish_the_save_and_stop_in_one_line(tmp_path):
    save = tmp_path / "save"
    run = Run(tmp_path / "run", *BASE, *LARGE, "--train-iters", "100000", "--save", str(save), "--save-interval",
              "2")
    try:
        deadline = time.time() + 240
        while not writing(save, 2):
            assert run.proc.poll() is None and time.time() < deadline, run.err.read_text()[-3000:]
            time.sleep(0.01)
        # a terminal's Ctrl-C reaches the whole process group, helpers included
        os.killpg(run.proc.pid, signal.SIGINT)
        time.sleep(0.3)
        assert writing(save, 2), "the save ended before the second Ctrl-C: make the model larger"
        os.killpg(run.proc.pid, signal.SIGINT)
        code = run.proc.wait(timeout=120)
    finally:
        run.kill_session()
    err = run.err.read_text()
    assert code == 1, err[-3000:]
    assert "Traceback" not in err and "ERROR" not in err, err[-3000:]
    assert run.stderr_lines() == [
        f"stopping once the checkpoint of iteration 2 in {save} is written (a save cut short would be left "
        f"half-written)",
        f"error: stopped by SIGINT after iteration 2; saved iteration 2 in {save} (resume with --load {save})",
    ]
    assert tracked(save) == 2
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000002"]
    assert (save / "iter_0000002" / "checksums.json").is_file()


def test_a_second_ctrl_c_during_the_stop_save_finishes_it(tmp_path):
    """The first Ctrl-C stops the run at the next boundary, which saves; the second lands in that save."""
    save = tmp_path / "save"
    run = Run(tmp_path / "run", *BASE, *LARGE, "--train-iters", "100000", "--save", str(save))
    try:
        run.wait_for("iteration      1/", timeout=240)
        os.killpg(run.proc.pid, signal.SIGINT)
        deadline = time.time() + 120
        while not any(writing(save, i) for i in range(1, 6)):
            assert run.proc.poll() is None and time.time() < deadline, run.err.read_text()[-3000:]
            time.sleep(0.01)
        [folder] = save.glob("iter_*")
        time.sleep(0.2)
        assert not (folder / "checksums.json").exists(), "the save ended before the second Ctrl-C"
        os.killpg(run.proc.pid, signal.SIGINT)
        code = run.proc.wait(timeout=120)
    finally:
        run.kill_session()
    err = run.err.read_text()
    assert code == 1 and "Traceback" not in err and "ERROR" not in err, err[-3000:]
    iteration = int(folder.name.split("_")[1])
    assert run.stderr_lines()[0].startswith(f"stopping once the checkpoint of iteration {iteration} in {save} is "
                                            f"written")
    assert run.stderr_lines()[1:] == [f"error: stopped by SIGINT after iteration {iteration}; saved iteration "
                                      f"{iteration} in {save} (resume with --load {save})"]
    assert tracked(save) == iteration and (folder / "checksums.json").is_file()
