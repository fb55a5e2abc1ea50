"""The eval split a run or `mimo eval` reads is checked before any worker starts and named by the option that gave
the dataset; `mimo data convert llava --test-fraction` gives a converted dataset the test split `mimo eval --split
test` reads; `mimo eval --eval-iters 0` and `--pack-sequences` without `--data` are one line each."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from helpers import run_mimo
from mimo.errors import UsageError

CPU = {"TORCH_COMPILE_DISABLE": "1"}


def _llava(root, count=40):
    from PIL import Image

    (root / "images").mkdir()
    records = []
    for i in range(count):
        Image.new("RGB", (32, 24), (i * 6, 80, 160)).save(root / "images" / f"{i}.png")
        records.append({"id": f"r{i}", "image": f"{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": f"shade {i}"}]})
    (root / "llava.json").write_text(json.dumps(records))


def _config(data, eval_data=None, eval_iters=1):
    from mimo.core.config import DataOptions, EvalOptions, RunConfig

    return RunConfig(provider="mock-vlm", data=DataOptions(data=data),
                     evaluation=EvalOptions(eval_iters=eval_iters, eval_data=eval_data))


def test_convert_llava_holds_records_out_for_a_test_split(tmp_path):
    from mimo.core.run.preflight import _check_datasets
    from mimo.data.convert.llava import convert_llava

    _llava(tmp_path)
    both = convert_llava(tmp_path / "llava.json", tmp_path / "images", tmp_path / "both", val_fraction=0.25,
                         test_fraction=0.25, say=lambda line: None)
    assert both.train and both.val and both.test and both.train + both.val + both.test == 40
    assert f"{both.test} test" in both.summary()
    _check_datasets(_config(tmp_path / "both"), split="test")  # mimo eval --split test finds it
    _check_datasets(_config(tmp_path / "both"), split="val")
    again = convert_llava(tmp_path / "llava.json", tmp_path / "images", tmp_path / "again", val_fraction=0.25,
                          say=lambda line: None)
    assert again.val == both.val and not again.test  # the same records held out for val: the hash decides
    with pytest.raises(UsageError, match=r"^--data .*again: the dataset has no test split: hold some samples out "
                                         r"for it when making the dataset \(mimo data convert llava --test-fraction "
                                         r"F, energon prepare --split-ratio 8,1,1; docs/evaluation.md\)$"):
        _check_datasets(_config(tmp_path / "again"), split="test")
    with pytest.raises(UsageError, match="must each lie in"):
        convert_llava(tmp_path / "llava.json", tmp_path / "images", tmp_path / "bad", val_fraction=0.5,
                      test_fraction=0.5, say=lambda line: None)


def test_eval_data_without_a_val_split_is_named_before_any_worker(tmp_path):
    from mimo.core.run.preflight import _check_datasets

    with_val, without = tmp_path / "with_val", tmp_path / "without"
    assert run_mimo("data", "sample", str(with_val), "--num-samples", "16", "--shard-size", "8",
                    "--val-shards", "1").returncode == 0
    assert run_mimo("data", "sample", str(without), "--num-samples", "16").returncode == 0
    with pytest.raises(UsageError, match=r"^--eval-data .*without: the dataset has no val split: hold some"):
        _check_datasets(_config(with_val, eval_data=without))
    _check_datasets(_config(without, eval_data=with_val))  # --data's val split is not read: no refusal
    _check_datasets(_config(without, eval_iters=0))  # no evaluation: no split needed
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--nproc-per-node", "2", "--data",
                      str(with_val), "--eval-data", str(without), "--eval-iters", "1", "--train-iters", "1",
                      "--num-workers", "0", env=CPU)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: --eval-data {without}: the dataset has no "
                                                             f"val split")
    assert "mimo run: provider" not in result.stdout  # refused before the workers said anything


def test_mimo_eval_refuses_eval_iters_0():
    result = run_mimo("eval", "--provider", "mock-vlm", "--device", "cpu", "--load", "/nonexistent",
                      "--eval-iters", "0", env=CPU)
    assert result.returncode == 2
    assert "mimo eval --eval-iters 0: an evaluation reads at least one global batch" in result.stderr


def test_pack_sequences_without_data_is_one_line(tmp_path):
    from mimo.cli.main import app

    def plan(*args):
        return CliRunner().invoke(app, ["plan", "--provider", "mock-vlm", "--device", "cpu", *args])

    for flag in (["--pack-sequences"], ["--packing-buffer-size", "8"]):
        result = plan(*flag)
        assert result.exit_code == 2, result.output
        assert f"{flag[0]} packs --data's samples; without --data the provider's synthetic batches are not packed" \
            in result.output
    assert plan().exit_code == 0 and plan("--no-pack-sequences").exit_code == 0
    data = tmp_path / "ds"
    assert run_mimo("data", "sample", str(data), "--num-samples", "8").returncode == 0
    assert plan("--pack-sequences", "--data", str(data)).exit_code == 0
