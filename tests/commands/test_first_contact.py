"""What a new user meets first: `mimo --version`, help that fits a terminal, a plain install without extras, a
whole run in one file, a run's closing summary, and a console that carries mimo's lines only."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from helpers import REPO, install_distribution, run_mimo

# Notices of the libraries that must never reach the console (docs/telemetry.md); an option named --...-warning (or its
# setting truncation_warning) is not one.
FOREIGN = re.compile(r"(?<![-_])warning|Traceback|^[IWE]\d{4} |Filling reading buffer|Saving info|Collapsing split|it/s\]",
                     re.IGNORECASE | re.MULTILINE)
# Every line a training or evaluation run prints.
RUN_LINE = re.compile(r"^(mimo (run|eval): |iteration +\d|validation \(|predictions \(|  Q: |saved checkpoint |"
                      r"loaded checkpoint |loaded weights "
                      r"|resumed from |  last lm loss: |  data: |  (checkpoint|metrics|tensorboard|profile|log file): )")


def assert_only_run_lines(result):
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == "", result.stderr[-3000:]
    stray = [line for line in result.stdout.splitlines() if not RUN_LINE.match(line)]
    assert not stray, stray


def test_version_names_the_stack():
    result = run_mimo("--version")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    lines = result.stdout.splitlines()
    for prefix in ("mimo ", "python ", "torch ", "megatron-core 0.19", "megatron-energon ", "transformer-engine: ",
                   "mamba-ssm: "):
        assert any(line.startswith(prefix) for line in lines), (prefix, lines)


@pytest.mark.parametrize("command", [
    ["run", "--help"], ["eval", "--help"], ["plan", "--help"], ["generate", "--help"], ["--help"],
    ["providers", "list"],
    ["providers", "show", "nemotron-moe-vlm-tiny"], ["ckpt", "export-hf", "--help"], ["data", "sample", "--help"],
])
def test_help_and_tables_keep_names_whole_at_80_columns(command):
    result = run_mimo(*command, env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    assert "…" not in result.stdout, result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    if command == ["run", "--help"]:
        for name in ("--use-distributed-optimizer", "--no-use-distributed-optimizer", "--prefetch-microbatches",
                     "--dist-ckpt-optim-fully-reshardable", "--ckpt-assume-constant-structure"):
            assert re.search(rf"(^|\s){re.escape(name)}(\s|$)", result.stdout, re.MULTILINE), name
    if command[:2] == ["providers", "show"]:
        assert re.search(r"^\s+vision_hidden_size\s", result.stdout, re.MULTILINE)


BLOCKER = """
import importlib.machinery, sys
BLOCKED = {"safetensors", "transformers", "transformer_engine", "mamba_ssm", "causal_conv1d", "matplotlib"}
class _WithoutExtras(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None  # as if not installed: find_spec None, import raises ModuleNotFoundError
        return super().find_spec(name, path, target)
sys.meta_path = [_WithoutExtras if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def test_plain_install_without_extras_trains_evaluates_plans_and_says_what_an_extra_adds(tmp_path, tmp_target):
    """Without the hf, te, ssm and bench extras' modules (blocked at import): run, eval, plan, ckpt inspect and
    a third-party provider work; import-hf reads safetensors itself (no extra), a folder without weights is one
    line."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    probe = subprocess.run([sys.executable, "-c", "import safetensors"], capture_output=True,
                           env={**os.environ, "PYTHONPATH": str(blocker)})
    assert probe.returncode == 1 and b"No module named 'safetensors'" in probe.stderr  # the blocker blocks
    install_distribution(REPO / "tests" / "example_provider", tmp_target)
    path = [blocker, tmp_target]
    ckpt = tmp_path / "ckpt"
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--train-iters", "3", "--save", str(ckpt),
                      extra_path=path)
    assert_only_run_lines(result)
    assert "finished 3 iterations" in result.stdout
    assert_only_run_lines(run_mimo("eval", "--provider", "mock-vlm", "--load", str(ckpt), "--eval-iters", "1",
                                   extra_path=path))
    for command in (["plan", "--provider", "mock-vlm"], ["ckpt", "inspect", str(ckpt)], ["--version"]):
        result = run_mimo(*command, extra_path=path)
        assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "safetensors" not in run_mimo("--version", extra_path=path).stdout
    assert_only_run_lines(run_mimo("run", "--provider", "patch-vlm", "--train-iters", "2", extra_path=path))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "nemotron_h"}')
    result = run_mimo("ckpt", "import-hf", str(hf), str(tmp_path / "out"), extra_path=path)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: {hf} is not a Hugging Face model folder (config.json with "
                                     f"model.safetensors or model.safetensors.index.json)")


def test_a_whole_run_in_one_file(tmp_path):
    """--config holds provider, settings and loop options; the command line wins; --print-config writes the
    effective run in the same form; each checkpoint keeps it; unknown names are one line with the closest."""
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(textwrap.dedent(f"""
        provider: mock-vlm
        settings:
          hidden_size: 32
        training:
          train_iters: 4
          micro_batch_size: 2
        optimizer:
          lr: 2e-3
        checkpoint:
          save: {tmp_path / "ckpt"}
    """))
    printed = run_mimo("run", "--config", str(run_yaml), "--train-iters", "3", "--print-config")
    assert printed.returncode == 0 and printed.stderr == "", printed.stderr
    effective = yaml.safe_load(printed.stdout)
    assert effective["provider"] == "mock-vlm" and effective["settings"]["hidden_size"] == 32
    assert effective["training"]["train_iters"] == 3  # the command line wins over the file
    assert effective["training"]["micro_batch_size"] == 2 and effective["optimizer"]["lr"] == 0.002
    assert effective["logging"]["log_interval"] == 10  # every option, defaults included
    result = run_mimo("run", "--config", str(run_yaml), "--log-interval", "1", "--metrics-file",
                      str(tmp_path / "m.jsonl"))
    assert_only_run_lines(result)
    kept = tmp_path / "ckpt" / "iter_0000004" / "run.yaml"
    assert yaml.safe_load(kept.read_text())["training"]["train_iters"] == 4
    # the kept file repeats the run: the same losses from it
    again = run_mimo("run", "--config", str(kept), "--save", str(tmp_path / "again"), "--metrics-file",
                     str(tmp_path / "again.jsonl"))
    assert_only_run_lines(again)
    losses = [[r["lm_loss"] for r in map(yaml.safe_load, (tmp_path / name).read_text().splitlines())]
              for name in ("m.jsonl", "again.jsonl")]
    assert losses[0] == losses[1] and len(losses[0]) == 4

    bad = tmp_path / "bad.yaml"
    for text, message in (
        ("provider: mock-vlm\ntrain_iters: 3\n", "unknown section 'train_iters'; 'train_iters' is an option of "
                                                  "section 'training'"),
        ("provider: mock-vlm\ntraining:\n  train_iter: 3\n", "did you mean 'train_iters'?"),
        ("provider: mock-vlm\ntraining:\n  lr: 3\n", "'lr' belongs in section 'optimizer'"),
        ("provider: mock-vlm\ntrainig:\n  train_iters: 3\n", "did you mean 'training'?"),
        ("provider: mock-vlm\ntraining:\n  train_iters: many\n", "training.train_iters must be an integer"),
        ("provider: mock-vlm\nsettings:\n  hidden_sise: 3\n", "did you mean 'hidden_size'?"),
    ):
        bad.write_text(text)
        result = run_mimo("run", "--config", str(bad))
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert message in result.stderr, (message, result.stderr)
    settings = tmp_path / "settings.yaml"
    settings.write_text("train_iters: 3\n")
    result = run_mimo("run", "--provider", "mock-vlm", "--provider-config", str(settings))
    assert result.returncode == 2
    assert "'train_iters' is a loop option, not a provider setting: pass --train-iters" in result.stderr


def test_summary_heterogeneous_save_and_a_resume_with_nothing_left(tmp_path):
    """A heterogeneous run's saves print no megatron-core warning; the summary names the checkpoint and outputs;
    a resume past the end says so in one line; one that trains further ends with its own summary."""
    common = ["--provider", "mock-vlm", "--nproc-per-node", "3", "--encoder-ranks", "1", "--save",
              str(tmp_path / "a")]
    # --verbose shows the libraries' notices: megatron-core's check of the common state across ranks is among
    # them when it fails, so its absence says that every rank's common state is the same.
    result = run_mimo("--verbose", "run", *common, "--train-iters", "4", "--save-interval", "2", "--metrics-file",
                      str(tmp_path / "m.jsonl"), "--tensorboard-dir", str(tmp_path / "tb"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Transformer Engine and Apex are not installed" in result.stderr  # the notices do show
    assert "common state dict differs" not in result.stderr
    assert not [line for line in result.stdout.splitlines() if not RUN_LINE.match(line)]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("mimo run: provider mock-vlm | images: ranks 0-0 TP1 PP1 DP1, 121,792 params | "
                               "language: ranks 1-2 TP1 PP1 DP2, 133,376 params")
    summary = lines[lines.index(next(line for line in lines if line.startswith("mimo run: finished"))):]
    assert summary[0].startswith("mimo run: finished 4 iterations (1 to 4 of 4) in ")
    assert summary[1].startswith("  last lm loss: train ") and "(iteration 4)" in summary[1]
    assert summary[2:] == [f"  checkpoint: {tmp_path / 'a' / 'iter_0000004'}", f"  metrics: {tmp_path / 'm.jsonl'}",
                           f"  tensorboard: {tmp_path / 'tb'}"]
    done = run_mimo("run", *common, "--train-iters", "4", "--load", str(tmp_path / "a"))
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.strip().splitlines()[-1] == (
        f"nothing to train: the checkpoint in {tmp_path / 'a'} is at iteration 4 and this run ends at iteration 4; "
        f"raise --train-iters to train further")
    assert not re.search(r"^iteration +\d", done.stdout, re.MULTILINE) and "finished" not in done.stdout
    further = run_mimo("run", *common, "--train-iters", "6", "--load", str(tmp_path / "a"))
    assert_only_run_lines(further)
    assert "mimo run: finished 2 iterations (5 to 6 of 6)" in further.stdout


def test_cpu_runs_speak_per_rank_and_pretrained_says_what_it_loaded(tmp_path):
    first = run_mimo("run", "--provider", "mock-vlm", "--train-iters", "2", "--device", "cpu", "--save",
                     str(tmp_path / "a"))
    assert_only_run_lines(first)
    assert "tokens/s/rank" in first.stdout and "GPU" not in first.stdout and "TFLOP" not in first.stdout
    result = run_mimo("run", "--provider", "mock-vlm", "--train-iters", "2", "--device", "cpu", "--pretrained",
                      str(tmp_path / "a"))
    assert_only_run_lines(result)
    assert re.search(rf"^loaded weights from {re.escape(str(tmp_path / 'a' / 'iter_0000002'))} \(saved at iteration 2 "
                     rf"by provider mock-vlm\) in [\d.]+ s; optimizer, schedule and data start anew$",
                     result.stdout, re.MULTILINE), result.stdout


def test_verbose_and_log_file_show_the_libraries_notices(tmp_path):
    log = tmp_path / "debug.log"
    result = run_mimo("--log-file", str(log), "data", "sample", str(tmp_path / "ds"))
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.strip() == f"wrote 64 samples in 4 shards to {tmp_path / 'ds'}"
    text = log.read_text()
    assert "Transformer Engine and Apex are not installed" in text and "energon prepare: " in text
    verbose = run_mimo("--verbose", "data", "sample", str(tmp_path / "ds2"))
    assert "Transformer Engine and Apex are not installed" in verbose.stderr
    assert not FOREIGN.search(verbose.stdout)
