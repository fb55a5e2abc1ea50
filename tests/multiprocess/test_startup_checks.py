"""What `mimo run` checks before any work: declared setting rules, every output path, the checkpoint against the
model, and options that read as people expect. Each failure is one line, exit 2, and nothing trains."""

import re

import pytest

from helpers import run_mimo
from mimo.core.config import (COMPONENTS, CheckpointOptions, LaunchOptions, LoggingOptions, OptimizerOptions,
                              PerformanceOptions, RunConfig, SchedulerOptions, TrainingOptions)
from mimo.core.parallel.optim import check_schedule
from mimo.core.run.output_paths import check_output_file, check_output_paths
from mimo.errors import UsageError

CPU = ("run", "--provider", "mock-vlm", "--device", "cpu", "--train-iters", "2", "--log-interval", "1")


def refused(result) -> str:
    """The one error line of a run that stopped before training."""
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert "iteration" not in result.stdout and "Traceback" not in result.stderr
    return lines[0]


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("not a directory")
    return path


@pytest.mark.parametrize("where, message", [
    (lambda f: LoggingOptions(tensorboard_dir=f), "--tensorboard-dir {f} is a file, not a directory"),
    (lambda f: LoggingOptions(profile_dir=f / "prof"), "--profile-dir {f}/prof: {f} is a file, not a directory"),
    (lambda f: LoggingOptions(memory_snapshot_dir=f), "--memory-snapshot-dir {f} is a file, not a directory"),
    (lambda f: LoggingOptions(metrics_file=f / "m.jsonl"),
     "--metrics-file {f}/m.jsonl: {f} is a file, not a directory"),
    (lambda f: LoggingOptions(metrics_file=f.parent), "--metrics-file {d} is a directory, not a file"),
    (lambda f: CheckpointOptions(save=f / "deep" / "ckpt"), "--save {f}/deep/ckpt: {f} is a file, not a directory"),
])
def test_output_paths_that_cannot_be_written_are_named(a_file, where, message):
    options = where(a_file)
    config = RunConfig(provider="mock-vlm", **{"logging" if isinstance(options, LoggingOptions) else "checkpoint":
                                               options})
    with pytest.raises(UsageError) as err:
        check_output_paths(config)
    assert str(err.value) == message.format(f=a_file, d=a_file.parent)


def test_output_paths_are_created_and_left_clean(tmp_path):
    config = RunConfig(provider="mock-vlm", logging=LoggingOptions(
        tensorboard_dir=tmp_path / "tb", profile_dir=tmp_path / "p" / "q", metrics_file=tmp_path / "m" / "x.jsonl"),
        checkpoint=CheckpointOptions(save=tmp_path / "ckpt"))
    check_output_paths(config)
    assert all((tmp_path / d).is_dir() for d in ("tb", "p/q", "ckpt"))
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["x.jsonl"]  # the probes are gone
    assert all(not any((tmp_path / d).iterdir()) for d in ("tb", "p/q", "ckpt"))


def test_a_tensorboard_dir_that_is_a_file_stops_the_run_before_training(a_file, tmp_path):
    metrics = tmp_path / "m.jsonl"
    line = refused(run_mimo(*CPU, "--tensorboard-dir", str(a_file), "--metrics-file", str(metrics)))
    assert line == f"error: --tensorboard-dir {a_file} is a file, not a directory"
    assert not metrics.exists()


def test_settings_that_break_a_declared_rule_stop_the_run(tmp_path):
    metrics = tmp_path / "m.jsonl"
    line = refused(run_mimo(*CPU, "--set", "hidden_size=60", "--set", "num_attention_heads=7",
                            "--metrics-file", str(metrics)))
    assert line == ("error: setting 'num_attention_heads' of provider 'mock-vlm' is 7: it must divide hidden_size "
                    "(60)")
    assert refused(run_mimo(*CPU, "--set", "hidden_size=-4")) == (
        "error: setting 'hidden_size' of provider 'mock-vlm' is -4: it must be at least 1")
    assert not metrics.exists()


def test_boolean_options_are_pairs_without_doubled_negatives():
    result = run_mimo("run", "--help", env={"COLUMNS": "240"})
    assert result.returncode == 0, result.stderr
    assert "--no-no-" not in result.stdout
    for pair in ("--save-optim", "--load-optim", "--load-scheduler", "--save-rng", "--load-rng"):
        assert f"{pair} " in result.stdout and f"--no-{pair[2:]} " in result.stdout, pair


def test_a_checkpoint_of_another_shape_is_refused_naming_the_setting(tmp_path):
    save = tmp_path / "save"
    first = run_mimo(*CPU, "--train-iters", "1", "--save", str(save))
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoint = save / "iter_0000001"
    shape = "tensor language_model.module.decoder.final_layernorm.bias has shape [64] there, [32] here"
    # --load resumes with the settings it was saved with: a differing --set is refused before start-up, naming
    # both values and the run file; --pretrained starts a new run, whose model must fit the checkpoint's
    expected = {"--load": f"error: --set hidden_size=32, but {checkpoint} was saved with hidden_size=64 ({checkpoint}"
                          f"/run.yaml holds every setting it was trained with): a resumed run keeps them; drop --set "
                          f"hidden_size, or start a new run from these weights with --pretrained instead of --load",
                "--pretrained": f"error: --pretrained {checkpoint} was saved with other settings: hidden_size 64 "
                                f"there, 32 here; its model does not fit this run's ({shape})"}
    for how in ("--load", "--pretrained"):
        metrics = tmp_path / f"m{how}.jsonl"
        line = refused(run_mimo(*CPU, how, str(save), "--set", "hidden_size=32", "--metrics-file", str(metrics)))
        assert line == expected[how]
        assert not metrics.exists() or metrics.read_text() == ""  # never written: nothing trained
    # A resume under another precision may not, with optimizer state (a resume keeps every saved setting:
    # tests/multiprocess/test_resume_settings.py).
    line = refused(run_mimo(*CPU, "--load", str(save), "--precision", "bf16"))
    assert line.startswith(f"error: --precision bf16 differs from the checkpoint's fp32 ({checkpoint})")


@pytest.mark.parametrize("options, message", [
    (TrainingOptions(micro_batch_size=0), "--micro-batch-size must be at least 1, got 0"),
    (OptimizerOptions(lr=float("nan")), "--lr must be a finite number, got nan"),
    (OptimizerOptions(lr=1e-5, min_lr=1e-4), "--min-lr 0.0001 is above --lr 1e-05"),
    (OptimizerOptions(lr=-1.0), "--lr must be 0 or more, got -1.0"),
    (OptimizerOptions(adam_beta1=1.5), "--adam-beta1 must lie in [0, 1), got 1.5"),
    (OptimizerOptions(weight_decay=-0.1), "--weight-decay must be 0 or more, got -0.1"),
    (OptimizerOptions(clip_grad=-1.0), "--clip-grad must be 0 or more, got -1.0"),
    (SchedulerOptions(lr_decay_iters=0), "--lr-decay-iters must be at least 1, got 0"),
    (SchedulerOptions(lr_warmup_iters=-1), "--lr-warmup-iters must be 0 or more, got -1"),
    (LaunchOptions(distributed_timeout_minutes=0.0), "--distributed-timeout-minutes must be positive, got 0.0"),
    (LoggingOptions(flop_check_iteration=0), "--flop-check-iteration must be at least 1, got 0"),
    (LaunchOptions(nnodes=2), "--nnodes > 1 needs --rdzv-endpoint host:port"),
    (LaunchOptions(nnodes=2, rdzv_endpoint="node0"), "--rdzv-endpoint node0 must be host:port (e.g. node0:29500)"),
    (CheckpointOptions(save_interval=5), "--save-interval needs --save DIR"),
    (CheckpointOptions(keep_last=2), "--keep-last needs --save DIR"),
    (SchedulerOptions(lr_decay_style="WSD"), "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (LoggingOptions(profile_with_stack=True), "--profile-with-stack records stacks in a profile"),
])
def test_each_component_checks_its_own_options_alone_and_within_the_run(options, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        options.validate()
    name = next(c.name for c in COMPONENTS if isinstance(options, c.options))
    with pytest.raises(UsageError, match=re.escape(message)):
        RunConfig(provider="mock-vlm", **{name: options}).validate()


def test_what_crosses_components_is_the_run_configs_to_check():
    fp8, graphs = PerformanceOptions(fp8="tensorwise"), PerformanceOptions(cuda_graphs=True)
    overlap = PerformanceOptions(overlap_param_gather=True, overlap_grad_reduce=True)
    for alone in (fp8, graphs, overlap):
        alone.validate()  # fine on their own: what they need is another component's
    with pytest.raises(UsageError, match="--fp8 tensorwise needs --precision bf16"):
        RunConfig(provider="mock-vlm", performance=fp8).validate()
    with pytest.raises(UsageError, match="--cuda-graphs needs --precision bf16"):
        RunConfig(provider="mock-vlm", performance=graphs).validate()
    with pytest.raises(UsageError, match="--overlap-param-gather needs --use-distributed-optimizer"):
        RunConfig(provider="mock-vlm", performance=overlap).validate()
    RunConfig(provider="mock-vlm", performance=overlap, training=TrainingOptions(precision="bf16"),
              optimizer=OptimizerOptions(use_distributed_optimizer=True)).validate()


def test_a_warmup_as_long_as_the_decay_is_refused_before_the_scheduler_asserts_it():
    # plan.prepare calls this with the run's global batch (4 here) and length in samples
    for scheduler, message in ((SchedulerOptions(lr_warmup_iters=5), "--lr-warmup-iters 5 is not shorter than the "
                                "learning-rate decay (the whole run: 2 in the same units)"),
                               (SchedulerOptions(lr_warmup_samples=8, lr_decay_iters=1),
                                "--lr-warmup-samples 8 is not shorter than the learning-rate decay (--lr-decay-iters: "
                                "4 in the same units)")):
        with pytest.raises(UsageError, match=re.escape(message)):
            check_schedule(scheduler, global_batch_size=4, train_samples=8)
    check_schedule(SchedulerOptions(lr_warmup_iters=1), global_batch_size=4, train_samples=8)


def test_a_commands_result_file_is_checked_before_its_work(tmp_path, a_file):
    # mimo eval --json, mimo generate --output: written at the end, where a bad path was a traceback
    with pytest.raises(UsageError, match=f"^--json {a_file}/e.json: {a_file} is a file, not a directory$"):
        check_output_file("--json", a_file / "e.json")
    with pytest.raises(UsageError, match=f"^--output {tmp_path} is a directory, not a file$"):
        check_output_file("--output", tmp_path)
    check_output_file("--json", tmp_path / "new" / "e.json")
    assert (tmp_path / "new").is_dir() and not (tmp_path / "new" / "e.json").exists()


def test_an_iteration_the_run_never_reaches_is_refused():
    from mimo.core.run.plan import _check_chosen_iterations

    # they profiled or counted nothing, silently
    with pytest.raises(UsageError, match=r"^--profile-step-end 6 is past the run's last iteration \(2\)"):
        _check_chosen_iterations(LoggingOptions(profile_dir="p"), train_iters=2)
    with pytest.raises(UsageError, match=r"^--flop-check-iteration 3 is past the run's last iteration \(2\)"):
        _check_chosen_iterations(LoggingOptions(flop_check_iteration=3), train_iters=2)
    _check_chosen_iterations(LoggingOptions(), train_iters=2)  # the default window without --profile-dir
    _check_chosen_iterations(LoggingOptions(profile_dir="p", profile_step_start=1, profile_step_end=2), train_iters=2)


def test_a_rendezvous_host_that_does_not_resolve_is_refused_before_the_launch():
    from mimo.core.run.launch import check_rendezvous_host

    # torch's rendezvous retried it until its timeout: the run hung
    with pytest.raises(UsageError, match=r"^--rdzv-endpoint nowhere.invalid:29500: host 'nowhere.invalid' is not "
                                         r"known here \("):
        check_rendezvous_host("nowhere.invalid:29500")
    check_rendezvous_host("localhost:29500")
    check_rendezvous_host(None)
