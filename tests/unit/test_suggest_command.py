"""`mimo plan --suggest` a user can act on: rows comparable across global batches (tokens/s/GPU first, each
row's batch in samples and tokens), the first layout's `mimo run` command whole and valid, one option a line, and
the memory limit named after the GPU it is (the calibration's where none is visible or given)."""

from __future__ import annotations

import json
import shlex

import pytest
from typer.testing import CliRunner

from mimo.core.memory import fit

BASE = ["--provider", "mock-vlm", "--precision", "bf16", "--device", "cuda"]


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(fit, "visible_gpu_gib", lambda: None)  # the same limit on any machine


def mimo(*args, columns=80):
    from mimo.cli.main import app

    result = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})
    return result


def suggest(*args, gpus=4, columns=80):
    result = mimo("plan", *BASE, "--suggest", "--gpus", str(gpus), *args, columns=columns)
    assert result.exit_code == 0, result.output
    return result.output


def test_each_row_shows_its_global_batch_and_tokens_per_gpu_comes_first():
    report = json.loads(suggest("--json"))
    rows = report["layouts"]
    batches = {row["global_batch_samples"] for row in rows}
    assert len(batches) > 1  # CP and TP take data-parallel lanes: the batches differ
    for row in rows:
        llm = row["layout"]
        lanes = 4 // (llm["llm_tp"] * llm["llm_cp"] * llm["llm_pp"]) if not llm["encoder_ranks"] else None
        if lanes:
            assert row["global_batch_samples"] == 4 * lanes * row["num_microbatches"]  # micro-batch 4
        assert row["global_batch_tokens"] == pytest.approx(row["global_batch_samples"] * 64)  # mock: 64 tokens
    text = suggest()
    header = next(line for line in text.splitlines() if line.lstrip().startswith("#  "))
    assert header.split()[:3] == ["#", "tokens/s/GPU", "global"] and "ms/iter" in header
    first = text.splitlines()[text.splitlines().index(header) + 1].split()
    assert first[:3] == ["1", f"{rows[0]['tokens_per_s_per_gpu']:,.0f}", f"{rows[0]['global_batch_samples']:,}"]
    assert f"({rows[0]['global_batch_tokens']:,.0f} tokens)" in text
    assert "--global-batch-size N lists layouts of one batch" in text
    # with one batch for every row there is nothing to note
    one = suggest("--global-batch-size", "16")
    assert "lists layouts of one batch" not in one and "most tokens/s/GPU first" in one


def test_the_recommended_command_is_printed_whole_one_option_a_line():
    report = json.loads(suggest("--json", "--micro-batch-size", "2"))
    expected = report["layouts"][0]["command"]
    assert expected[:4] == ["mimo", "run", "--nproc-per-node", "4"]
    text = suggest("--micro-batch-size", "2")
    lines = text.splitlines()
    start = lines.index("mimo run \\")
    block = []
    for line in lines[start:]:
        block.append(line)
        if not line.endswith(" \\"):
            break
    assert shlex.split(" ".join(line.removesuffix(" \\") for line in block)) == expected
    assert all(len(shlex.split(line.removesuffix(" \\"))) <= 2 for line in block[1:])  # one option a line
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]


@pytest.mark.parametrize("gpus", [4, 8])
def test_every_suggested_command_is_a_layout_mimo_accepts(gpus):
    """Each row's command, given to `mimo plan`, is the layout the row describes (colocated TP included: the
    encoders share it only where --encoder-tp says so)."""
    rows = json.loads(suggest("--json", "--micro-batch-size", "1", gpus=gpus))["layouts"]
    for row in rows:
        assert row["command"][:2] == ["mimo", "run"]
        result = mimo("plan", *row["command"][2:], "--json")
        assert result.exit_code == 0, (row["command"], result.output)
        plan = json.loads(result.output)
        language = next(m for m in plan["modules"] if m["module"] == "language")
        layout = row["layout"]
        assert (language["tp"], language["cp"], language["pp"]) == (layout["llm_tp"], layout["llm_cp"],
                                                                   layout["llm_pp"]), row["command"]
        assert plan["world_size"] == gpus and plan["global_batch_size"] == row["global_batch_samples"]


def test_the_command_keeps_what_was_typed_and_merges_recompute():
    from mimo.cli.suggest import recompute_value

    assert recompute_value({"images": "selective", "language": "full"}, ["images", "language"]) == \
        "images=selective,language=full"
    assert recompute_value({"*": "full"}, ["images", "language"]) == "full"
    assert recompute_value({"*": "selective", "language": "full"}, ["images", "language"]) == \
        "images=selective,language=full"
    assert recompute_value({"*": "none"}, ["images", "language"]) is None
    rows = json.loads(suggest("--json", "--recompute", "images=selective", "--seed", "7", "--no-grad-accum-fusion",
                              "--set", "num_layers=2", "--llm-tp", "2", "--nproc-per-node", "3"))["layouts"]
    command = rows[0]["command"]
    joined = " ".join(command)
    assert "--seed 7" in joined and "--no-grad-accum-fusion" in joined and "--set num_layers=2" in joined
    assert "--device cuda" in joined and "--json" not in joined and "--suggest" not in joined
    assert command.count("--nproc-per-node") == 1 and "--nproc-per-node 4" in joined  # the N GPUs, not the typed
    assert "--llm-tp 2" not in joined or rows[0]["layout"]["llm_tp"] == 2  # the layout's own, not the typed one
    assert command[command.index("--recompute") + 1].startswith("images=selective")


def test_under_a_run_file_the_layouts_sizes_are_written_where_the_file_sets_others(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("provider: mock-vlm\nlayout:\n  llm_tp: 2\n  encoder_tp: 2\n")
    rows = json.loads(mimo("plan", "--config", str(run), "--precision", "bf16", "--device", "cuda", "--suggest",
                           "--gpus", "4", "--json").output)["layouts"]
    colocated = next(row for row in rows if row["flags"].startswith("(colocated"))
    assert colocated["command"][2:6] == ["--nproc-per-node", "4", "--config", str(run)]
    assert "--llm-tp 1" in " ".join(colocated["command"]) and "--encoder-tp 1" in " ".join(colocated["command"])
    result = mimo("plan", *colocated["command"][2:], "--json")
    assert result.exit_code == 0, result.output
    assert all(m["tp"] == 1 for m in json.loads(result.output)["modules"])


def test_the_default_limit_is_the_gpu_the_times_are_estimated_for(monkeypatch):
    from mimo.core.step_time import calibration

    cal = calibration.load()
    report = json.loads(suggest("--json"))
    assert report["limit_gib"] == cal.reference_gpu_gib == pytest.approx(143771 / 1024, abs=0.05)
    assert report["limit_source"] == f"{cal.reference_gpu}, the GPU the times are estimated for"
    assert f"fit 140.4 GiB ({cal.reference_gpu}, the GPU the times are estimated for)" in " ".join(suggest().split())
    assert json.loads(suggest("--json", "--gpu-memory", "70"))["limit_source"] == "--gpu-memory"
    monkeypatch.setattr(fit, "visible_gpu_gib", lambda: 79.2)
    report = json.loads(suggest("--json"))
    assert (report["limit_gib"], report["limit_source"]) == (79.2, "the visible GPU")
    # what fits nothing says which limit it tried
    monkeypatch.setattr(fit, "visible_gpu_gib", lambda: None)
    refused = mimo("plan", "--provider", "nemotron-moe-vlm-54l", "--suggest", "--gpus", "2", "--device", "cuda")
    assert refused.exit_code == 2
    assert f"fits 140.4 GiB ({cal.reference_gpu}, the GPU the times are estimated for)" in refused.output


def test_without_a_gpu_device_auto_plans_for_gpus_and_device_cpu_for_the_cpu():
    """A login node (no GPU, --device auto) plans for the GPUs the run will have: the provider's GPU backend, as
    the memory limit; an explicit --device cpu keeps to what the CPU runs (no sequence parallelism)."""
    def layouts(*args):
        result = mimo("plan", "--provider", "nemotron-moe-vlm-tiny", "--micro-batch-size", "1", "--suggest",
                      "--gpus", "2", "--json", *args)
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["layouts"]

    auto = layouts()
    assert any(row["sequence_parallel"] for row in auto)
    assert all("--device" not in row["command"] for row in auto)  # only what was typed
    assert not any(row["sequence_parallel"] for row in layouts("--device", "cpu"))


def test_the_qwen_moe_vlm_is_laid_out_with_its_experts_split_and_each_layout_is_one_mimo_plan_accepts():
    """qwen3.5-vl-35b-a3b on 16 GPUs: its 256 experts fit only split over EP; the suggested commands are layouts
    `mimo plan` accepts at the same memory limit (its hooks' estimate, the gated delta net's TP and CP under the
    GPU backend)."""
    report = json.loads(mimo("plan", "--provider", "qwen3.5-vl-35b-a3b", "--device", "cuda", "--micro-batch-size",
                             "1", "--suggest", "--gpus", "16", "--json").output)
    rows = report["layouts"]
    assert rows and all(row["layout"]["llm_ep"] > 1 for row in rows)
    for row in rows[:3]:
        result = mimo("plan", *row["command"][2:], "--gpu-memory", str(report["limit_gib"]), "--json")
        assert result.exit_code == 0, (row["command"], result.output)
        language = next(m for m in json.loads(result.output)["modules"] if m["module"] == "language")
        assert language["ep"] == row["layout"]["llm_ep"]
