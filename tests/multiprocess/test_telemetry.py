"""What a run reports: TensorBoard scalars, non-finite iterations, per-module timing."""


from helpers import install_distribution, read_metrics, run_mimo, write_distribution

NAN_LOSS = """
    import os
    import mimo

    calls = 0

    @mimo.hookimpl(tryfirst=True)
    def loss(output_tensor, loss_mask):
        # One micro-batch per iteration in these tests: the n-th call is iteration n.
        global calls
        calls += 1
        mask = loss_mask.float()
        total = (output_tensor.float() * mask).sum()
        if str(calls) in os.environ.get("NAN_AT_ITERATIONS", "").split(","):
            total = total * float("nan")
        return total, mask.sum().int()
"""


def test_tensorboard_has_megatrons_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--train-iters", "4", "--log-interval",
                      "2", "--tensorboard-dir", str(tmp_path / "tb"))
    assert result.returncode == 0, result.stderr[-2000:]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in ("lm loss", "learning-rate", "grad-norm", "batch-size", "loss-scale", "iteration-time"):
        assert name in tags and f"{name} vs samples" in tags, name
        assert len(events.Scalars(name)) == 4
    assert {"throughput/tokens-per-sec", "throughput/tflops-per-gpu"} <= tags
    assert [e.step for e in events.Scalars("lm loss vs samples")] == [4, 8, 12, 16]


def test_non_finite_iterations_are_skipped_counted_and_stop_the_run(tmp_path):
    site = install_distribution(write_distribution(tmp_path / "nan", "nan-loss", "nan_loss", "nan-loss", NAN_LOSS),
                                tmp_path / "site")
    metrics = tmp_path / "m.jsonl"
    args = ("run", "--provider", "mock-vlm", "--device", "cpu", "--train-iters", "12", "--log-interval", "1",
            "--max-nan-iters", "3", "--lr-decay-style", "linear", "--metrics-file", str(metrics))
    save = tmp_path / "save"  # the stop saves first: the weights of non-finite iterations were not updated
    result = run_mimo(*args, "--save", str(save), extra_path=[site], env={"NAN_AT_ITERATIONS": "2,5,6,7,8"})
    records = read_metrics(metrics)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "error: 3 iterations in a row had a non-finite loss or gradient norm (the last: iteration 7), so "
        f"training stopped; lower --lr, check the data, or raise --max-nan-iters; saved iteration 7 in {save} (resume "
        f"with --load {save})")
    assert (save / "iter_0000007" / "common.pt").is_file()
    by_iteration = {r["iteration"]: r for r in records}
    assert by_iteration[2]["nan_iterations"] == 1 and by_iteration[2]["skipped_iterations"] == 1
    assert by_iteration[3]["nan_iterations"] == 1 and by_iteration[4]["lm_loss"] == by_iteration[4]["lm_loss"]
    assert by_iteration[6]["nan_iterations"] == 3 and by_iteration[7]["nan_iterations"] == 4  # the stop is logged
    assert 8 not in by_iteration
    # A skipped iteration does not advance the schedule: iteration 3 uses the rate a clean run uses at 2.
    clean = run_mimo(*args[:-2], "--metrics-file", str(tmp_path / "clean.jsonl"))
    assert clean.returncode == 0
    clean_lr = {r["iteration"]: r["lr"] for r in read_metrics(tmp_path / "clean.jsonl")}
    assert by_iteration[3]["lr"] == clean_lr[2] and clean_lr[3] < clean_lr[2]


def test_module_timing_summary_on_the_logging_rank_only():
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--train-iters", "4", "--log-interval",
                      "2", "--nproc-per-node", "2", "--encoder-ranks", "1", "--log-timers")
    assert result.returncode == 0, result.stderr[-2000:]
    summaries = [line for line in result.stdout.splitlines() if line.startswith("time per iteration")]
    assert len(summaries) == 2  # one per log interval, from one rank
    encoder, llm = summaries[-1].split("||")
    for phase in ("forward", "backward", "bridge", "optimizer", "data"):
        assert phase in encoder and phase in llm
    assert encoder.strip().startswith("time per iteration, ms (max over ranks): images:")
    assert llm.strip().startswith("language:")
    assert "start-up " not in result.stdout  # a start under MIMO_SLOW_START_S (60 s) says nothing of its parts


def test_a_slow_start_up_says_where_its_time_went():
    """Above MIMO_SLOW_START_S seconds (default 60: the whole model's weights take minutes to draw), the logging
    rank names the start-up's parts (below it nothing: the test above)."""
    slow = run_mimo("run", "--provider", "mock-vlm", "--train-iters", "1", env={"MIMO_SLOW_START_S": "0"})
    line = next(x for x in slow.stdout.splitlines() if x.startswith("start-up "))
    assert slow.returncode == 0 and all(part in line for part in ("joining", "the model", "the optimizer"))
