"""A signal (SLURM's SIGTERM, a Ctrl-C, --exit-signal) stops every rank at an iteration boundary: saved, exit 1,
one line, no process left. A launcher killed outright takes its workers with it."""

import signal
import sys
import time

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
from fault_battery import BASE, Run, tracked  # noqa: E402


def stopped(tmp_path, number, *args, after="iteration      2/", target=None):
    """Start a long run, send `number` once it logged `after`, and return (exit code, run) when it ends."""
    run = Run(tmp_path / "run", *BASE, "--train-iters", "100000", *args)
    try:
        run.wait_for(after)
        (target(run) if target else run.signal)(number)
        code = run.proc.wait(timeout=120)
        deadline = time.time() + 30
        while run.session_pids() and time.time() < deadline:
            time.sleep(0.05)
        assert run.session_pids() == [], "processes left behind"
    finally:
        run.kill_session()
    return code, run


def test_exit_signal_stops_one_process_without_a_save(tmp_path):
    code, run = stopped(tmp_path, signal.SIGUSR1, "--exit-signal", "SIGUSR1")
    assert code == 1
    [line] = run.stderr_lines()
    assert line.startswith("error: stopped by SIGUSR1 after iteration ") and "nothing saved (no --save)" in line


# SIGTERM, the default --exit-signal, stops the first run of the fault battery's lock part (one process, saved).
@pytest.mark.parametrize("number", [signal.SIGINT], ids=["SIGINT"])
def test_two_processes_stop_together_and_save(tmp_path, number):
    save = tmp_path / "save"
    code, run = stopped(tmp_path, number, "--nproc-per-node", "2", "--save", str(save))
    assert code == 1
    lines = run.stderr_lines()  # the launcher's agent narrates nothing; one worker says how it ended
    assert len(lines) == 1, run.err.read_text()[-3000:]
    iteration = tracked(save)
    assert lines[0] == (f"error: stopped by {signal.Signals(number).name} after iteration {iteration}; saved "
                        f"iteration {iteration} in {save} (resume with --load {save})")
    assert (save / f"iter_{iteration:07d}" / "checksums.json").is_file()


def test_workers_of_a_launcher_killed_outright_stop_and_save(tmp_path):
    save = tmp_path / "save"
    code, run = stopped(tmp_path, signal.SIGKILL, "--nproc-per-node", "2", "--save", str(save))
    assert code == -9 and tracked(save) is not None  # the workers got SIGTERM from the kernel and saved
