"""The benchmarks' own logic on the CPU: the minimal megatron-core loop trains exactly what mimo's loop trains, and
the checkpoint benchmark reads mimo's save/load lines."""

import json
import os
import subprocess
import sys

from helpers import REPO


def test_minimal_loop_matches_mimos_loop(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(REPO / "bench" / "loop_overhead.py"), "--quick", "--rounds", "1",
                             "--block", "2", "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "loop_overhead.json").read_text())
    assert [row["loop"] for row in report["rows"]] == ["mimo", "minimal"]
    assert len(report["mimo_losses"]) == 2 and report["loss_gap"] < 1e-5, report["loss_gap"]


def test_checkpoint_benchmark_reads_the_log_lines(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from checkpoint import parse
    finally:
        sys.path.remove(str(REPO / "bench"))
    from mimo.core.checkpoint.layout import report_io

    directory = tmp_path / "iter_0000012"
    directory.mkdir()
    (directory / "shard.distcp").write_bytes(b"x" * 4096)
    report_io("saved", directory, 2.0, blocked=0.25)
    report_io("loaded", directory, 1.0)
    events = parse(capsys.readouterr().out)
    assert [(e["event"], e["seconds"], e["blocked_seconds"]) for e in events] == [("saved", 2.0, 0.25),
                                                                                  ("loaded", 1.0, None)]


def test_data_loader_benchmark_packs_what_training_reads(tmp_path):
    """The loader bench at toy size: the provider's own loader packs several samples a row and drops none, and
    the same packed data trains (`--train`: the case's `mimo run` on the bench's dataset)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(REPO / "bench" / "data_loader.py"), "--quick", "--cases", "dense",
                             "--workers", "1", "--train", "--out", str(tmp_path)], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "data_loader.json").read_text())
    packed, unpacked, train = report["rows"]
    assert (packed["packing"], unpacked["packing"], train["source"]) == (True, False, "mimo run, cpu")
    assert packed["samples_per_row"] > 1 and unpacked["samples_per_row"] == 1
    assert packed["fill"] > unpacked["fill"] and packed["skipped"] == unpacked["skipped"] == 0
    assert train["status"] == "ok" and packed["ratio_vs_train"] > 0


def test_te_path_benchmark_writes_the_record_fields(tmp_path):
    """bench/te_path.py at toy size: each run's record carries the fields docs/benchmarks/ keeps, with figures."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(REPO / "bench" / "te_path.py"), "--quick", "--cases",
                             "dense-local-selective", "--iterations", "4", "--warmup", "1", "--out", str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "records" / "dense-local-selective.json").read_text())
    assert record["status"] == "ok" and record["options"] == "--recompute selective", record
    for field in ("device", "provider", "backend", "precision", "layout", "ms_per_iter", "tokens_per_s_per_gpu",
                  "tflops_per_gpu", "peak_mem_gib"):
        assert record[field] is not None, field
    assert "mfu" in record and record["mfu"] is None  # a CPU has no peak FLOP/s to divide by
    assert (record["backend"], record["precision"], record["provider"]) == ("local", "bf16", "mock-vlm")
    assert "--recompute selective" in record["command"] and record["ms_per_iter"] > 0
    # the first iteration apart, the steady ones as min/median/max
    assert record["first_iteration_s"] > 0 and record["to_first_iteration_end_s"] > record["first_iteration_s"]
    spread = record["ms_per_iter_spread"]
    assert spread["n"] == 3 and spread["min"] <= spread["median"] <= spread["max"]
