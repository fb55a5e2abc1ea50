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
    assert (record["tokens_counted"], record["flops_counted"]) == ("rows", "rows")  # synthetic: no padding
    assert (record["backend"], record["precision"], record["provider"]) == ("local", "bf16", "mock-vlm")
    assert "--recompute selective" in record["command"] and record["ms_per_iter"] > 0
    # the first iteration apart, the steady ones as min/median/max
    assert record["first_iteration_s"] > 0 and record["to_first_iteration_end_s"] > record["first_iteration_s"]
    spread = record["ms_per_iter_spread"]
    assert spread["n"] == 3 and spread["min"] <= spread["median"] <= spread["max"]


def test_te_path_names_the_iterations_that_captured_a_graph_and_the_figures_without_them():
    """A recomputed encoder's graph is captured once per new bucket of patches (0.1-0.3 s, in that iteration):
    the benchmark reads which iterations did from the run's output and gives the steady figures without them."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import te_path
    finally:
        sys.path.remove(str(REPO / "bench"))
    output = "\n".join([
        "recomputed layers (32): CUDA graph for 10240 tokens in 9 sequences captured in 0.25 s (1 so far)",
        "first iteration 4.3 s: Triton: 10 compiled or loaded in 0.0 s",
        " iteration      1/4 | consumed samples        8 | elapsed ms/iter   4658.7",
        " iteration      2/4 | consumed samples       16 | elapsed ms/iter   1000.0",
        "recomputed layers (32): CUDA graph for 8192 tokens in 9 sequences captured in 0.12 s (2 so far)",
        "recomputed layers (32): CUDA graph for 6144 tokens in 9 sequences captured in 0.18 s (3 so far)",
        " iteration      3/4 | consumed samples       24 | elapsed ms/iter   1300.0",
        " iteration      4/4 | consumed samples       32 | elapsed ms/iter   1100.0",
    ])
    assert te_path.capture_iterations(output) == [1, 3]
    kept = [{"iteration": i, "elapsed_ms": ms, "tflops_per_gpu": 400_000 / ms}
            for i, ms in ((2, 1000.0), (3, 1300.0), (4, 1100.0))]
    row = {}
    te_path.without_captures(row, kept, [1, 3])
    assert row["capture_iterations"] == [1, 3]
    assert row["ms_per_iter_without_captures_spread"] == {"min": 1000.0, "median": 1050.0, "max": 1100.0, "n": 2}
    assert row["tflops_without_captures_spread"]["n"] == 2
    [note] = te_path.capture_notes([{"case": "slice", **row}])
    assert note.startswith("slice: 2 steady iterations captured no graph: ms/iter 1000-1050-1100")


def test_encoder_bucket_counts_predict_the_captures_the_gpu_runs_logged(tmp_path):
    """bench/encoder_buckets.py keys the slice's steps as RecomputeGraphs does: with the default bucket it names
    the iterations at which every recorded H100 run of the slice logged a capture (docs/benchmarks.md (g))."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import encoder_buckets
    finally:
        sys.path.remove(str(REPO / "bench"))
    from mimo.plugins.kit.recompute_graphs import TOKEN_BUCKET

    provider, assignments, images_per_step = encoder_buckets.SLICE
    rows = json.loads((REPO / "docs" / "benchmarks" / "slice_h100.json").read_text())["rows"]
    longest = max(len(row["ms_per_iter_by_iteration"]) for row in rows)  # 100 (call B)
    steps = encoder_buckets.step_lengths(provider, assignments, images_per_step, steps=longest, seed=1234)
    default = encoder_buckets.bucket_figures(steps, TOKEN_BUCKET, warmup=12, window_end=40)
    predicted = default["capture_steps"]
    for row in rows:
        logged = len(row["ms_per_iter_by_iteration"])
        assert [step for step in predicted if step <= logged] == row["capture_iterations"], (row["call"], row["run"])
    finer = encoder_buckets.bucket_figures(steps, TOKEN_BUCKET // 2, warmup=12, window_end=40)
    assert finer["padding_share"] < default["padding_share"] and finer["buckets"] > default["buckets"]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(REPO / "bench" / "encoder_buckets.py"), "--quick", "--steps", "20",
                             "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "encoder_buckets.json").read_text())
    assert [row["token_bucket"] for row in report["rows"]] == [512, 1024, 2048, 4096]
    assert all(row["captures_in_warmup"] + row["captures_in_window"] + row["captures_after"] == row["buckets"]
               for row in report["rows"])


def test_flop_split_lists_the_documented_workloads(tmp_path):
    """bench/flop_split.py prints the encoder's share of the slice's FLOPs for docs/benchmarks.md's workloads, and
    the candidates include one near an even split."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(REPO / "bench" / "flop_split.py"), "--out", str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "flop_split.json").read_text())
    shares = {row["workload"]: row["encoder_share"] for row in report["rows"]}
    assert abs(shares["images_per_sample=2 patches_per_image=4096"] - 0.510) < 0.001
    assert shares["(defaults)"] < 0.15
