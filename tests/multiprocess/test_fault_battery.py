"""The fault battery (scripts/fault_battery.py) in CI, smaller than its full run in docs/verification.md: two kills
around saves, a shard truncated and damaged in place (test_checkpoint covers the other files), the save lock, a
worker killed in a 2-process run."""

import json
import sys

from helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import fault_battery  # noqa: E402


def test_the_fault_battery_passes(tmp_path):
    code = fault_battery.main([str(tmp_path), "--kills", "2", "--seed", "3",
                               "--corrupt-files", "__0_0.distcp"])
    report = json.loads((tmp_path / "battery.json").read_text())
    failed = [case for case in report["cases"] if not case["ok"]]
    assert code == 0 and not failed, failed
    parts = [case["part"] for case in report["cases"]]
    assert parts.count("kill") == 2 and parts.count("corrupt") == 2 and parts.count("lock") == 2 and "worker" in parts
    kills = [case for case in report["cases"] if case["part"] == "kill"]
    assert all(case["max_loss_difference"] in (0.0, None) for case in kills)  # identical losses after a resume
    assert (tmp_path / "battery.md").read_text().count("| yes |") == len(report["cases"])
