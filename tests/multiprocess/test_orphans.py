"""Nothing left behind (issue 32): a checkpoint save starts no helper process (megatron-core's Manager server
and resource tracker outlived a killed run), and SIGKILL of the main process alone, during async saves with two
loader workers and during `mimo ckpt import-hf`, leaves no process alive 10 s later and nothing a rerun trips on
(the full battery: scripts/fault_battery.py --parts orphans, docs/verification.md)."""

import json
import subprocess
import sys

from helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import fault_battery  # noqa: E402

SAVE_WITHOUT_PROCESSES = r"""
import sys, psutil, torch, torch.distributed as dist
from mimo.core.run import lifeline
from mimo.core.run.launch import init_process
init_process("cpu")
lifeline.install()
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
import os; os.makedirs(sys.argv[1])
before = {p.pid for p in psutil.Process().children(recursive=True)}
state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(12.0).reshape(3, 4), replica_id=0)}
dist_checkpointing.save(state, sys.argv[1], sharded_strategy=TorchDistSaveShardedStrategy())
after = {p.pid for p in psutil.Process().children(recursive=True)}
loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4), replica_id=0)},
                                 sys.argv[1])
assert torch.equal(loaded["w"], torch.arange(12.0).reshape(3, 4))
print(type(filesystem_async._results_queue).__name__, sorted(after - before))
dist.destroy_process_group()
"""


def test_a_save_starts_no_process(tmp_path):
    """megatron-core's private `_results_queue` is what mimo relies on: a release that stops reading it starts
    its Manager process again, and this fails."""
    result = subprocess.run([sys.executable, "-c", SAVE_WITHOUT_PROCESSES, str(tmp_path / "ckpt")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "ResultsQueue []"


def test_kills_of_the_main_process_leave_nothing_behind(tmp_path, omni_folder):
    folder = omni_folder  # save_omni(), built once per test run (conftest.py)
    code = fault_battery.main([str(tmp_path / "battery"), "--parts", "orphans", "--orphan-kills", "2",
                               "--orphan-kinds", "data,import", "--hf-folder", str(folder), "--seed", "1"])
    report = json.loads((tmp_path / "battery" / "battery.json").read_text())
    failed = [case for case in report["cases"] if not case["ok"]]
    assert code == 0 and not failed and len(report["cases"]) == 2, failed
    assert all(case["seconds_until_all_gone"] < 10 and not case["left"] for case in report["cases"])
