"""`mimo ckpt export-hf CK OUT --adapter-only` (docs/lora.md): adapters trained on the tiny omni folder, written as a
PEFT adapter, loaded by peft onto that folder with transformers give the logits of mimo's merged model exported
whole (merge-lora, then export-hf), routed experts' adapters included (PEFT's target_parameters); what cannot be
exported is one line each; export-hf without --adapter-only merges the adapters into their recorded base first."""

from __future__ import annotations

import json

import pytest
from helpers import run_mimo

ENV = {"TORCH_COMPILE_DISABLE": "1"}
RUN = ("run", "--provider", "nemotron-moe-vlm-tiny", "--device", "cpu", "--micro-batch-size", "2",
       "--global-batch-size", "2", "--seed", "3", "--lora-rank", "4", "--lr", "2e-2")
# every kind of adapted linear transformers' omni model loads as a module of its own: the LLM's fused qkv (split
# into q, k, v), Mamba's in_proj (saved in five parts), shared experts and the output layer; RADIO's blocks
# (stacked layers, its fused qkv split again on load), its patch embedders; the projector
TARGETS = "language:linear_qkv,linear_proj,in_proj,out_proj,shared_experts,output_layer;images:all;projection:all"


def _mimo(*args: str) -> str:
    result = run_mimo(*args, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _refused(*args: str) -> str:
    result = run_mimo(*args, env=ENV)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stderr.strip()


def _logits_check(tmp_path, omni_folder, adapters, peft_dir):
    """Merge and export `adapters` whole; PEFT's adapter `peft_dir` on the base gives the whole export's logits,
    each adapter tensor where the file says. Returns the adapter config."""
    merged, whole = tmp_path / "merged", tmp_path / "whole"
    _mimo("ckpt", "merge-lora", str(adapters), str(merged))
    _mimo("ckpt", "export-hf", str(merged), str(whole))

    import torch
    from peft import PeftModel
    from PIL import Image
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(whole)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pixels = (torch.rand(64, 96, 3, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8)
    inputs = processor(images=[Image.fromarray(pixels.numpy())], text=text, return_tensors="pt")

    def logits(model):
        with torch.no_grad():
            return model.eval()(**inputs).logits

    reference = logits(AutoModelForImageTextToText.from_pretrained(whole, dtype=torch.float32))
    base = AutoModelForImageTextToText.from_pretrained(omni_folder, dtype=torch.float32)
    assert (logits(base) - reference).abs().max() > 0.05  # the adapters matter
    model = PeftModel.from_pretrained(base, peft_dir)
    torch.testing.assert_close(logits(model), reference, atol=2e-5, rtol=1e-5)

    # every adapter tensor landed where the file says (none dropped as an unexpected key)
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    saved = load_file(peft_dir / "adapter_model.safetensors")
    from peft.utils import get_peft_model_state_dict

    loaded = get_peft_model_state_dict(model)
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    return config, saved


def test_a_peft_adapter_on_the_base_gives_the_merged_models_logits(tmp_path, omni_folder):
    adapters, peft_dir = tmp_path / "adapters", tmp_path / "peft"
    _mimo(*RUN, "--pretrained", str(omni_folder), "--lora-targets", TARGETS, "--train-iters", "2",
          "--save", str(adapters))
    printed = _mimo("ckpt", "export-hf", str(adapters), str(peft_dir), "--adapter-only")
    assert f"on {omni_folder}" in printed  # the base it names: the Hugging Face folder trained on
    assert sorted(p.name for p in peft_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    config, saved = _logits_check(tmp_path, omni_folder, adapters, peft_dir)
    assert len(saved) == 2 * len(config["target_modules"]) == 2 * 29 and not config["target_parameters"]

    # export-hf without --adapter-only: the adapters merged into the base their checkpoint records, then the whole
    # model, in one command: merge-lora's and export-hf's tensors
    import torch
    from safetensors.torch import load_file

    at_once = tmp_path / "at-once"
    printed = _mimo("ckpt", "export-hf", str(adapters), str(at_once))
    assert f"exported merged into their base --pretrained {omni_folder.resolve()}" in printed
    tensors = [{k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}
               for d in (at_once, tmp_path / "whole")]
    assert tensors[0].keys() == tensors[1].keys() and all(torch.equal(tensors[0][k], tensors[1][k])
                                                          for k in tensors[0])
    assert not any(p.name.startswith(".at-once") for p in tmp_path.iterdir())  # the merged scratch is gone
    # a whole model given to the adapters' export: one line
    merged = tmp_path / "merged"
    assert _refused("ckpt", "export-hf", str(merged), str(tmp_path / "x"), "--adapter-only").startswith(
        f"error: --adapter-only: {merged}/iter_0000000 holds a whole model, no LoRA adapters")


@pytest.mark.parametrize("layout, expert_gemm, targets", [("per-expert", "grouped_mm", "language:experts"),
                                                            ("shared", "megatron", "language:experts,in_proj")])
def test_expert_adapters_export_as_target_parameters(tmp_path, omni_folder, layout, expert_gemm, targets):
    """Routed-expert adapters (trained on mimo's grouped-GEMM experts, or megatron's SequentialMLP; alone, so that
    the logits show them, or with Mamba's): the experts' 3-D up_proj and down_proj as PEFT's target_parameters,
    the logits of the merged export."""
    adapters, peft_dir = tmp_path / "adapters", tmp_path / "peft"
    _mimo(*RUN, "--pretrained", str(omni_folder), "--lora-targets", targets,
          "--lora-experts", layout, "--set", f"expert_gemm={expert_gemm}", "--train-iters", "2",
          "--save", str(adapters))
    printed = _mimo("ckpt", "export-hf", str(adapters), str(peft_dir), "--adapter-only")
    config, saved = _logits_check(tmp_path, omni_folder, adapters, peft_dir)
    moe_layers = sorted({p.rpartition(".mixer.")[0] for p in config["target_parameters"]})
    assert moe_layers and config["target_parameters"] == [f"{layer}.mixer.experts.{p}" for layer in moe_layers
                                                          for p in ("down_proj", "up_proj")]
    assert f"{len(config['target_parameters'])} expert parameters" in printed
    assert len(saved) == 2 * len(config["target_modules"]) + 2 * len(config["target_parameters"])
    assert bool(config["target_modules"]) == ("in_proj" in targets)
