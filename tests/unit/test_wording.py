"""A count in a line says `1 image`, never `1 images` (mimo.wording), and the iteration line names skipped
iterations apart from skipped samples."""

from __future__ import annotations

import types

import pytest
from typer.testing import CliRunner

from mimo.wording import counted, plural


def test_counted_says_one_thing_and_many_things():
    assert counted(1, "image") == "1 image" and counted(0, "image") == "0 images" and counted(2, "rank") == "2 ranks"
    assert counted(1, "micro-batch") == "1 micro-batch" and counted(3, "micro-batch") == "3 micro-batches"
    assert counted(2, "image slot") == "2 image slots" and counted(1, "<image> placeholder") == "1 <image> placeholder"
    assert counted(1234, "sample", thousands=True) == "1,234 samples" and counted(2, "child", "children") == \
        "2 children"
    assert plural("pass") == "passes" and plural("box") == "boxes"


def test_a_sample_with_one_image_says_so():
    from mimo.data.conversation import Turn, place_images, split_placeholders

    with pytest.raises(ValueError, match=r"^the text has 2 <image> placeholders but the sample has 1 image$"):
        place_images([Turn("user", tuple(split_placeholders("<image>a<image>")))], 1)


def test_the_run_summary_says_one_iteration_and_names_every_skip_reason():
    from mimo.core.telemetry.summary import summary_lines

    def session(record):
        logging = types.SimpleNamespace(metrics_file=None, tensorboard_dir=None, profile_dir=None)
        plan = types.SimpleNamespace(train_iters=5, config=types.SimpleNamespace(logging=logging))
        logger = types.SimpleNamespace(trained_tokens=10, trained_seconds=1.0, records=[record])
        return types.SimpleNamespace(plan=plan, logger=logger, iteration=5, evaluations=None, checkpointer=None)

    record = {"lm_loss": 1.0, "iteration": 5, "skipped_samples": 1, "skipped_unreadable": 1}
    lines = summary_lines(session(record), 4, 2.0)
    assert lines[0].startswith("mimo run: finished 1 iteration (5 to 5 of 5)")
    assert "  data: 1 sample skipped as unreadable" in lines
    mixed = {**record, "skipped_samples": 3, "skipped_too_long": 2}
    assert "  data: 3 samples skipped (1 unreadable, 2 too long)" in summary_lines(session(mixed), 3, 2.0)


def test_ckpt_inspect_says_saved_on_one_rank(tmp_path, monkeypatch):
    from mimo.cli.main import app
    from mimo.core.checkpoint import layout

    (tmp_path / "metadata.json").write_text("{}")
    run = {"provider": "mock-vlm", "layout": {}, "world_size": 1, "parameters": {}, "settings": {}, "options": {}}
    monkeypatch.setattr(layout, "read_common", lambda target: {"iteration": 1, "consumed_samples": 1, "run": run,
                                                                "checkpoint_version": 1,
                                                                "contents": {"optimizer": False, "rng": False}})
    result = CliRunner().invoke(app, ["ckpt", "inspect", str(tmp_path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "iteration 1, 1 sample consumed, provider mock-vlm, 1 file," in result.output
    assert "saved on 1 rank\n" in result.output


def test_the_iteration_line_names_skipped_iterations_apart_from_skipped_samples():
    from mimo.core.telemetry.metrics import format_line

    record = {"iteration": 3, "consumed_samples": 12, "elapsed_ms": 10.0, "tokens_per_sec_per_gpu": 100.0,
              "lr": 1e-3, "lm_loss": 2.0, "grad_norm": 1.0, "loss_scale": 1.0, "skipped_iterations": 0,
              "nan_iterations": 0, "peak_memory_gib": 1.0, "skipped_samples": 22, "skipped_unreadable": 22}
    line = format_line(record, 10, per="rank")
    assert "| skipped iters 0 | nan iters 0 |" in line and "| skipped samples 22 unreadable" in line
    assert "| skipped 0 |" not in line


def test_cpu_peak_memory_is_the_process_rss_as_docs_cpu_md_says():
    import torch

    from helpers import REPO
    from mimo.core.telemetry.metrics import _peak_memory_gib

    assert _peak_memory_gib(torch.device("cpu")) > 0.05  # this process, with torch loaded
    limits = (REPO / "docs" / "cpu.md").read_text()
    assert "read 0" not in limits and "peak resident memory (its RSS)" in limits
