"""No run deletes, replaces or hides a complete checkpoint: the forgotten-`--load` sequence, `--start-anew`,
`--keep-last`, async saves, several processes, and a stop's save onto another run's checkpoint."""

import hashlib
import json
import shutil
import signal
import sys

import pytest
import torch

from helpers import REPO, run_mimo

sys.path.insert(0, str(REPO / "scripts"))
from fault_battery import BASE as SIGNALLED, Run  # noqa: E402

BASE = ("run", "--provider", "mock-vlm", "--device", "cpu", "--log-interval", "1")


def mimo(*args):
    result = run_mimo(*BASE, *args)
    return result


def fingerprint(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def loadable(save, iteration, tmp_path, layout):
    """A copy of one checkpoint resumes and trains one more iteration."""
    alone = tmp_path / f"alone{iteration}"
    shutil.copytree(save / f"iter_{iteration:07d}", alone / f"iter_{iteration:07d}")
    (alone / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    result = mimo("--train-iters", str(iteration + 1), "--load", str(alone), *layout)
    assert result.returncode == 0 and f"resumed from {alone} at iteration {iteration}" in result.stdout, \
        result.stderr[-2000:]


@pytest.mark.parametrize("layout", [(), ("--nproc-per-node", "2", "--async-save")], ids=["sync", "async-2-processes"])
def test_a_forgotten_load_keeps_every_complete_checkpoint(tmp_path, layout):
    ck = tmp_path / "ck"
    first = mimo("--train-iters", "20", "--save", str(ck), "--save-interval", "10", *layout)
    assert first.returncode == 0, first.stderr[-2000:]
    kept = {it: fingerprint(ck / f"iter_{it:07d}") for it in (10, 20)}

    forgot = mimo("--train-iters", "4", "--save", str(ck), "--save-interval", "2", *layout)
    assert forgot.returncode == 2 and forgot.stderr.strip().splitlines() == [
        f"error: --save {ck} already holds checkpoints (iter_0000010, iter_0000020) that this run does not load: add "
        f"--load {ck} to resume them (at iteration 20), or --start-anew to start a new run there that keeps them "
        f"where they are"]
    assert sorted(p.name for p in ck.iterdir()) == [".mimo-lock", "iter_0000010", "iter_0000020",
                                                    "latest_checkpointed_iteration.txt"]

    anew = mimo("--train-iters", "4", "--save", str(ck), "--save-interval", "2", "--start-anew", *layout)
    assert anew.returncode == 0, anew.stderr[-2000:]
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "4\n"
    resumed = mimo("--train-iters", "6", "--save", str(ck), "--load", str(ck), "--save-interval", "2",
                   "--keep-last", "1", *layout)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {ck} at iteration 4" in resumed.stdout
    assert (f"note: --save {ck} also holds 2 complete checkpoints of another run (iter_0000010, iter_0000020): kept "
            f"where they are") in resumed.stdout
    assert "removed" not in resumed.stdout
    # --keep-last 1 pruned this series (2, 4) down to 6, never the other run's
    assert sorted(p.name for p in ck.glob("iter_*")) == ["iter_0000006", "iter_0000010", "iter_0000020"]
    assert {it: fingerprint(ck / f"iter_{it:07d}") for it in (10, 20)} == kept
    inspected = run_mimo("ckpt", "inspect", str(ck), "--json")
    assert json.loads(inspected.stdout)["save_directory"] == {"this_run": [6], "other_runs": [10, 20],
                                                             "unfinished": []}
    for it in (10, 20):
        loadable(ck, it, tmp_path, layout)


def test_a_stop_never_saves_over_another_runs_checkpoint(tmp_path):
    save = tmp_path / "save"
    for it in range(1, 301):  # another run's complete checkpoints wherever the signal may land
        (save / f"iter_{it:07d}").mkdir(parents=True)
        torch.save({"series": "other"}, save / f"iter_{it:07d}" / "common.pt")
    run = Run(tmp_path / "run", *SIGNALLED, "--train-iters", "100000", "--save", str(save), "--start-anew")
    try:
        run.wait_for("iteration      2/")
        run.signal(signal.SIGTERM)
        code = run.proc.wait(timeout=120)
    finally:
        run.kill_session()
    [line] = run.stderr_lines()
    assert code == 1 and line.startswith("error: stopped by SIGTERM after iteration ") and line.endswith(
        f"not saved (its folder in {save} holds another run's checkpoint)"), line
    assert len(list(save.glob("iter_*"))) == 300
    assert all(torch.load(p / "common.pt") == {"series": "other"} for p in save.glob("iter_*"))
