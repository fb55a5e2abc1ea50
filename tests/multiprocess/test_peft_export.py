"""`mimo ckpt export-hf CK OUT --adapter-only` (docs/lora.md): adapters trained on the tiny omni folder, written as a
PEFT adapter, loaded by peft onto that folder with transformers give the logits of mimo's merged model exported
whole (merge-lora, then export-hf); what cannot be exported is one line each."""

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


def test_a_peft_adapter_on_the_base_gives_the_merged_models_logits(tmp_path, omni_folder):
    adapters, peft_dir, merged, whole = (tmp_path / n for n in ("adapters", "peft", "merged", "whole"))
    _mimo(*RUN, "--pretrained", str(omni_folder), "--lora-targets", TARGETS, "--train-iters", "2",
          "--save", str(adapters))
    printed = _mimo("ckpt", "export-hf", str(adapters), str(peft_dir), "--adapter-only")
    assert f"on {omni_folder}" in printed  # the base it names: the Hugging Face folder trained on
    assert sorted(p.name for p in peft_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    _mimo("ckpt", "merge-lora", str(adapters), str(merged))
    _mimo("ckpt", "export-hf", str(merged), str(whole))

    # each checkpoint kind given to the other export: one line
    assert _refused("ckpt", "export-hf", str(adapters), str(tmp_path / "x")) == (
        f"error: {adapters}/iter_0000002 holds LoRA adapters only: export them as a PEFT adapter with "
        f"--adapter-only, or the whole model after mimo ckpt merge-lora {adapters} MERGED")
    assert _refused("ckpt", "export-hf", str(merged), str(tmp_path / "x"), "--adapter-only").startswith(
        f"error: --adapter-only: {merged}/iter_0000000 holds a whole model, no LoRA adapters")

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
    assert len(saved) == 2 * len(config["target_modules"]) == 2 * 29
    for path in config["target_modules"]:
        layer = model.base_model.model.get_submodule(path)
        for matrix in ("A", "B"):
            assert torch.equal(getattr(layer, f"lora_{matrix}")["default"].weight,
                               saved[f"base_model.model.{path}.lora_{matrix}.weight"]), (path, matrix)


def test_expert_adapters_are_refused_with_the_way_out(tmp_path, omni_folder):
    """transformers loads Nemotron-H's routed experts as one 3-D tensor per linear: no module PEFT adapts."""
    adapters = tmp_path / "adapters"
    _mimo(*RUN, "--pretrained", str(omni_folder), "--lora-targets", "language:experts", "--train-iters", "1",
          "--save", str(adapters))
    assert _refused("ckpt", "export-hf", str(adapters), str(tmp_path / "peft"), "--adapter-only") == (
        "error: --adapter-only: the adapter on language_model.decoder.layers.2.mlp.experts.linear_fc1 (shared by the "
        "experts) cannot be exported to PEFT (language_model.backbone.layers.2.mixer.experts.0.up_proj.weight: "
        "transformers loads nemotron_h's routed experts as one 3-D tensor per linear (mixer.experts.up_proj, "
        f"down_proj), which peft 0.21 has no per-expert LoRA conversion for); export the merged model instead: mimo "
        f"ckpt merge-lora {adapters} MERGED, then mimo ckpt export-hf MERGED {tmp_path / 'peft'}")
    assert not (tmp_path / "peft").exists()
