"""Multi-node launch on one host: two `mimo run` launchers meeting at a rendezvous (1 and 2 processes per node),
and the ranks of an srun step (SLURM's variables set by hand), each train one run together."""

import socket

import pytest

from helpers import read_metrics, run_mimo
from test_signals import BASE, Run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def together(tmp_path, runs: list[Run]):
    try:
        codes = [run.proc.wait(timeout=300) for run in runs]
    finally:
        for run in runs:
            run.kill_session()
    assert codes == [0] * len(runs), [run.err.read_text()[-2000:] for run in runs]


@pytest.mark.parametrize("per_node", [1, 2])
def test_two_launchers_on_one_host_make_one_world(tmp_path, per_node):
    endpoint = f"127.0.0.1:{free_port()}"
    runs = [Run(tmp_path / f"node{n}", *BASE, "--train-iters", "2", "--nnodes", "2", "--nproc-per-node",
                str(per_node), "--rdzv-endpoint", endpoint, "--metrics-file", str(tmp_path / f"m{n}.jsonl"))
            for n in range(2)]
    together(tmp_path, runs)
    ranks = 2 * per_node
    banner = next(line for run in runs for line in run.out.read_text().splitlines() if line.startswith("mimo run:"))
    assert f"language: ranks 0-{ranks - 1} TP1 PP1 DP{ranks}" in banner
    logged = [read_metrics(tmp_path / f"m{n}.jsonl") for n in range(2)]
    assert sorted(len(records) for records in logged) == [0, 2]  # one rank of the world logs


def test_srun_tasks_are_the_ranks(tmp_path):
    common = {"SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    runs = [Run(tmp_path / f"task{n}", *BASE, "--train-iters", "2", "--metrics-file", str(tmp_path / f"m{n}.jsonl"),
                env={**common, "SLURM_PROCID": str(n), "SLURM_LOCALID": str(n)}) for n in range(2)]
    together(tmp_path, runs)
    assert "language: ranks 0-1 TP1 PP1 DP2" in runs[0].out.read_text()
    assert [r["iteration"] for r in read_metrics(tmp_path / "m0.jsonl")] == [1, 2]


def test_srun_without_a_meeting_point_is_one_line():
    result = run_mimo(*BASE, "--train-iters", "1", env={"SLURM_NTASKS": "2", "SLURM_PROCID": "0",
                                                        "SLURM_STEP_ID": "0", "MASTER_ADDR": ""})
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: under srun, set MASTER_ADDR and MASTER_PORT (e.g. the first host of $SLURM_JOB_NODELIST and a free "
        "port) so the tasks can meet"]


def test_spawned_cpu_workers_train_as_forked_ones(tmp_path):
    """GPU runs spawn their workers; CPU runs fork them from the launcher unless MIMO_WORKER_START=spawn: the two
    start paths give the same losses (the spawned one is the GPU path, checked here on CPU)."""
    args = ("run", "--provider", "mock-vlm", "--device", "cpu", "--nproc-per-node", "2", "--train-iters", "2",
            "--log-interval", "1", "--seed", "7")
    losses = {}
    for start in ("fork", "spawn"):
        metrics = tmp_path / f"{start}.jsonl"
        result = run_mimo(*args, "--metrics-file", str(metrics), env={"MIMO_WORKER_START": start})
        assert result.returncode == 0 and result.stderr == "", result.stderr[-3000:]
        losses[start] = [(m["lm_loss"], m["grad_norm"]) for m in read_metrics(metrics)]
    assert len(losses["fork"]) == 2 and losses["spawn"] == losses["fork"]
    refused = run_mimo(*args, env={"MIMO_WORKER_START": "thread"})
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: MIMO_WORKER_START=thread: choose fork (CPU workers forked from the launcher, the default) or spawn "
        "(fresh interpreters, as on GPUs)"]
