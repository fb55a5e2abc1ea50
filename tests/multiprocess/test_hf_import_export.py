"""Hugging Face Nemotron omni checkpoints in and out of mimo (core/checkpoint/hf*.py, providers/nemotron/hf/vlm.py), through the CLI:
a tiny random transformers `NemotronH_Omni_Reasoning_V3` shaped like nemotron-moe-vlm-tiny is saved, imported
(`mimo ckpt import-hf`), trained from (`--pretrained OUT` and `--pretrained HF_DIR`, colocated and heterogeneous)
and exported (`mimo ckpt export-hf`) back into a folder transformers loads, with the original bits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import read_metrics, run_mimo
from hf_models import TEXT, save_omni
from safetensors.torch import load_file

from mimo.core.checkpoint import hf
from mimo.errors import UsageError
from mimo.plugins import Registry
from mimo.plugins.settings import build_settings

PROVIDER = "nemotron-moe-vlm-tiny"
EXPERT_BIAS = "mixer.gate.e_score_correction_bias"  # moved by megatron-core's bias update in every training step
ENV = {"TORCH_COMPILE_DISABLE": "1"}
RUN = ("run", "--provider", PROVIDER, "--device", "cpu", "--log-interval", "1")


def _mimo(*args: str):
    result = run_mimo(*args, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture
def hf_dir(omni_folder):
    return omni_folder  # save_omni(TEXT), built once per test run (conftest.py)


@pytest.fixture
def imported(omni_imported):
    out, stdout = omni_imported  # its `mimo ckpt import-hf`, run once per test run (conftest.py)
    assert f"as provider {PROVIDER}" in stdout
    return out


def _assert_same_tensors(exported, original, except_suffix: str | None = None) -> None:
    """The exported folder loads into transformers' omni model with nothing missing or unexpected, and holds the
    original tensors (bit for bit, dtype included)."""
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    model, info = NemotronH_Omni_Reasoning_V3.from_pretrained(exported, output_loading_info=True)
    assert type(model).__name__ == "NemotronH_Omni_Reasoning_V3"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    got, want = load_file(exported / "model.safetensors"), load_file(original / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        if except_suffix and name.endswith(except_suffix):
            continue
        assert torch.equal(got[name], tensor), name


def test_import_writes_a_checkpoint_and_the_settings(imported):
    settings = (imported / hf.SETTINGS_FILE).read_text()
    assert settings.startswith(f"provider: {PROVIDER}\n") and "projection: mlp" in settings
    built = build_settings(Registry().get(PROVIDER)[0], [], imported / hf.SETTINGS_FILE)
    assert (built.hybrid_pattern, built.video_temporal_patch_size, built.class_tokens) == ("M*EME", 2, 2)
    assert (imported / "latest_checkpointed_iteration.txt").read_text().strip() == "0"


def test_import_then_export_gives_back_every_tensor(imported, hf_dir, tmp_path):
    _mimo("ckpt", "export-hf", str(imported), str(tmp_path / "hf"))
    _assert_same_tensors(tmp_path / "hf", hf_dir)


def test_training_from_the_import_or_the_folder_and_exporting_a_heterogeneous_checkpoint(imported, hf_dir, tmp_path):
    """--pretrained OUT and --pretrained HF_DIR start from the same weights (the same first loss), colocated and
    with the encoder on a rank of its own; the heterogeneous checkpoint exports to the original tensors (trained
    at learning rate 0: only megatron-core's expert-bias update moves a weight, by its rate of 1e-3 per step)."""
    config = ("--provider-config", str(imported / hf.SETTINGS_FILE), "--train-iters", "2")
    losses = {}
    for name, source in (("import", imported), ("folder", hf_dir)):
        metrics = tmp_path / f"{name}.jsonl"
        _mimo(*RUN, *config, "--pretrained", str(source), "--metrics-file", str(metrics))
        losses[name] = [r["lm_loss"] for r in read_metrics(metrics)]
    assert len(losses["import"]) == 2 and losses["import"] == losses["folder"]

    metrics, saved = tmp_path / "heterogeneous.jsonl", tmp_path / "heterogeneous"
    _mimo(*RUN, "--provider-config", str(imported / hf.SETTINGS_FILE), "--train-iters", "1", "--lr", "0",
          "--pretrained", str(hf_dir), "--nproc-per-node", "2", "--encoder-ranks", "1", "--save", str(saved),
          "--metrics-file", str(metrics))
    assert read_metrics(metrics)[0]["lm_loss"] == pytest.approx(losses["import"][0], rel=1e-6)
    _mimo("ckpt", "export-hf", str(saved), str(tmp_path / "hf"))
    _assert_same_tensors(tmp_path / "hf", hf_dir, except_suffix=EXPERT_BIAS)
    got, want = load_file(tmp_path / "hf" / "model.safetensors"), load_file(hf_dir / "model.safetensors")
    for name in (n for n in want if n.endswith(EXPERT_BIAS)):
        assert (got[name] - want[name]).abs().max() <= 1e-3 + 1e-7, name


def test_a_dense_llm_imports_into_tensor_parallel_ranks_and_exports_from_them(tmp_path):
    """An omni checkpoint whose LLM has no MoE layers (M * - M -) trains under --llm-tp 2 --encoder-tp 2 with the
    first loss of one rank, and its TP2 checkpoint (trained at learning rate 0) exports to the original bits."""
    hf_folder = save_omni(tmp_path / "omni", {**TEXT, "layers_block_type": ["mamba", "attention", "mlp", "mamba",
                                                                             "mlp"]})
    imported = tmp_path / "imported"
    _mimo("ckpt", "import-hf", str(hf_folder), str(imported))
    config = ("--provider-config", str(imported / hf.SETTINGS_FILE), "--pretrained", str(imported),
              "--train-iters", "1", "--lr", "0")
    _mimo(*RUN, *config, "--metrics-file", str(tmp_path / "tp1.jsonl"))
    _mimo(*RUN, *config, "--nproc-per-node", "2", "--llm-tp", "2", "--encoder-tp", "2",
          "--metrics-file", str(tmp_path / "tp2.jsonl"), "--save", str(tmp_path / "tp2"))
    tp1, tp2 = (read_metrics(tmp_path / f"{n}.jsonl")[0]["lm_loss"] for n in ("tp1", "tp2"))
    assert tp2 == pytest.approx(tp1, rel=1e-6)
    _mimo("ckpt", "export-hf", str(tmp_path / "tp2"), str(tmp_path / "hf"))
    _assert_same_tensors(tmp_path / "hf", hf_folder)


def test_a_config_the_provider_cannot_express_exits_2_with_one_line(hf_dir, tmp_path):
    folder = tmp_path / "omni"
    shutil.copytree(hf_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "downsample_ratio": 0.25}))
    result = run_mimo("ckpt", "import-hf", str(folder), str(tmp_path / "out"), env=ENV)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: omni config downsample_ratio=0.25: the provider pixel-shuffles 2 x 2 blocks only"]


def test_which_provider_reads_a_config():
    registry = Registry()
    with pytest.raises(UsageError, match="^no installed provider reads Hugging Face model_type 'llama'"):
        hf.find_provider(registry, {"model": {"model_type": "llama"}})
    with pytest.raises(UsageError, match=r"^Hugging Face config model_type='nemotron_h' is only the language model "
                                         r"of a VLM: give it as a part \(mimo run --pretrained-llm DIR"):
        hf.find_provider(registry, {"model": {"model_type": "nemotron_h"}})
    with pytest.raises(UsageError, match="^provider 'mock-vlm' does not read Hugging Face model_type "
                                         "'nemotron_h_omni' as a whole model"):
        hf.find_provider(registry, {"model": {"model_type": "nemotron_h_omni"}}, "mock-vlm")


def test_a_settings_file_for_another_provider_is_refused(tmp_path):
    path = tmp_path / hf.SETTINGS_FILE
    hf.write_settings(path, "nemotron-moe-vlm-mid", {"hidden_size": 64})
    with pytest.raises(UsageError, match=f"holds settings for provider 'nemotron-moe-vlm-mid', this run uses "
                                         f"'{PROVIDER}'"):
        build_settings(Registry().get(PROVIDER)[0], [], path)


def test_the_contract_checks_export_read_back_and_import_of_a_trained_model(monkeypatch):
    """mimo.testing's check of the three hooks on nemotron-moe-vlm-tiny with settings the omni model can express
    (the tiny variant's affine projection has no Hugging Face form: the plain check only notes that)."""
    from mimo.testing import check_provider

    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    report = check_provider(PROVIDER, ["projection=mlp", "projection_norm=true", "video_temporal_patch_size=2"])
    assert {"hf_settings", "hf_tensor_map", "hf_export_check", "hf_export"} <= report.hooks_called
    assert not any("Hugging Face" in note for note in report.notes), report.notes
