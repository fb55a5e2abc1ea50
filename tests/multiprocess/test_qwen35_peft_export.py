"""`mimo ckpt export-hf CK OUT --adapter-only` for the Qwen3.5 family: LoRA adapters trained from a tiny random
transformers Qwen3.5 VLM folder (the language model's gated attention and gated delta net projections, its MLPs or
its routed and shared experts, the output layer; the vision tower's blocks; the patch merger), written as a PEFT
adapter, which peft loads onto that folder with transformers' logits equal to those of mimo's merged model exported
whole. The MoE model's routed experts become PEFT's target_parameters on transformers' fused 3-D `gate_up_proj`
(each expert's gate_proj rows then its up_proj rows) and `down_proj`, also when the experts module held their
adapters (as transformer-engine's grouped experts do): that checkpoint merges as the experts' own linears merge it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import run_mimo
from qwen35_models import TOKENS, save_reference

ENV = {"TORCH_COMPILE_DISABLE": "1"}
TARGETS = "language:linear_qkv,linear_proj,in_proj,out_proj,{mlp},output_layer;images:all;projection:all"
HELD = "expert adapters held by the experts module"
# `mimo ARGS` whose grouped experts hold their per-expert adapters themselves, as transformer-engine's (which the
# CPU cannot build) do: mimo's grouped SequentialMLP then leaves its expert linears without adapters
_HOLDING = f"""
import sys
from mimo.core.adapters import grouped_experts
from mimo.core.run.forked_workers import run_cli

def holds(experts):
    print("{HELD}", file=sys.stderr)
    return True

grouped_experts.holds_per_expert = holds
sys.exit(run_cli(sys.argv[1:]))
"""


def _mimo(*args: str, held: bool = False) -> str:
    if held:
        result = subprocess.run([sys.executable, "-c", _HOLDING, *args], capture_output=True, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **ENV}, timeout=600)
        assert HELD in result.stderr, result.stderr[-3000:]
    else:
        result = run_mimo(*args, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _merged_tensors(save_dir):
    """Every tensor of a merged checkpoint (a save directory), whole."""
    from mimo.core.checkpoint.hf_export import Reader, saved_tensors
    from mimo.core.checkpoint.layout import iteration_dir, read_tracker

    directory = iteration_dir(save_dir, read_tracker(save_dir))
    saved = saved_tensors(directory)
    return Reader(directory, saved).load(sorted(saved))


def _inputs(folder):
    """Token ids with two images' placeholders between text, and the images as transformers' processor makes them."""
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    images = [Image.fromarray((torch.rand(h, w, 3, generator=gen) * 255).to(torch.uint8).numpy())
              for h, w in ((40, 56), (32, 32))]
    processed = processor(images=images, return_tensors="pt")
    grids = processed["image_grid_thw"]
    ids = torch.randint(0, 256, (3,), generator=gen).tolist()
    for grid in grids:
        text = torch.randint(0, 256, (4,), generator=gen).tolist()
        ids += [TOKENS["image_token_id"]] * (int(grid.prod()) // 4) + text  # 2 x 2 merged patches a token
    ids = torch.tensor([ids])
    return dict(input_ids=ids, pixel_values=processed["pixel_values"], image_grid_thw=grids,
                mm_token_type_ids=(ids == TOKENS["image_token_id"]).int())


@pytest.mark.parametrize("moe, experts, layout", [
    (False, "shared", ()), (True, "shared", ()), (True, "per-expert", ()),
    # per-expert adapters held by grouped experts (gated: fc1's B saved in gate and linear parts)
    (True, "per-expert", ("--set", "expert_gemm=grouped_mm", HELD)),
    # adapters saved over TP 2: the delta net's in_proj B in its sections' parts, each gathered whole
    (False, "shared", ("--nproc-per-node", "2", "--llm-tp", "2", "--encoder-tp", "2"))],
    ids=["dense", "moe-shared", "moe-per-expert", "moe-per-expert-held", "dense-tp2"])
def test_a_peft_adapter_on_the_base_gives_the_merged_models_logits(tmp_path, moe, experts, layout):
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    _, base = save_reference(tmp_path / "hf", moe)
    provider = "qwen3.5-vl-moe-tiny" if moe else "qwen3.5-vl-tiny"
    mlp = "experts,shared_experts" if moe else "linear_fc1,linear_fc2"
    adapters, peft_dir, merged, whole = (tmp_path / n for n in ("adapters", "peft", "merged", "whole"))
    _mimo("run", "--provider", provider, "--device", "cpu", "--micro-batch-size", "2", "--global-batch-size", "2",
          "--seed", "3", "--lora-rank", "4", "--lr", "2e-2", "--pretrained", str(base), "--lora-targets",
          TARGETS.format(mlp=mlp), "--lora-experts", experts, "--train-iters", "2", "--save", str(adapters),
          *(a for a in layout if a != HELD), held=HELD in layout)
    printed = _mimo("ckpt", "export-hf", str(adapters), str(peft_dir), "--adapter-only")
    _mimo("ckpt", "merge-lora", str(adapters), str(merged))  # the experts' own linears load the adapters
    if HELD in layout:  # merged by the experts module that held them: the same weights, bit for bit
        _mimo("ckpt", "merge-lora", str(adapters), str(tmp_path / "merged-held"), held=True)
        tensors, held_tensors = _merged_tensors(merged), _merged_tensors(tmp_path / "merged-held")
        assert tensors.keys() == held_tensors.keys()
        assert all(torch.equal(tensors[k], held_tensors[k]) for k in tensors)
    _mimo("ckpt", "export-hf", str(merged), str(whole))

    inputs = _inputs(whole)

    def logits(model):
        with torch.no_grad():
            return model.eval()(**inputs).logits

    reference = logits(AutoModelForImageTextToText.from_pretrained(whole, dtype=torch.float32))
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    assert (logits(model) - reference).abs().max() > 0.05  # the adapters matter
    model = PeftModel.from_pretrained(model, peft_dir)
    # W x + B A x (peft) and (W + B A) x (merged) round apart: about 1e-5 of logits near 1 in fp32, more on
    # some CPUs' kernels; the adapters themselves move the logits by over 0.05
    torch.testing.assert_close(logits(model), reference, atol=1e-4, rtol=1e-4)

    config = json.loads((peft_dir / "adapter_config.json").read_text())
    saved = load_file(peft_dir / "adapter_model.safetensors")
    # (peft's own state dict adds lm_head's base weight beside its adapter: it saves embedding-like layers whole)
    loaded = {k: v for k, v in get_peft_model_state_dict(model).items() if ".lora_" in k}
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    modules = config["target_modules"]
    # the language model's every projection, each block's fused qkv, the merger, the output layer
    for linear in ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_a",
                   "linear_attn.out_proj", "self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "visual.blocks.0.attn.qkv", "visual.merger.linear_fc2", "lm_head"):
        assert any(m.endswith(linear) or f"{linear}" in m for m in modules), (linear, modules)
    if moe:
        layers = sorted({p.rpartition(".mlp.")[0] for p in config["target_parameters"]})
        assert len(layers) == 4 and config["target_parameters"] == [
            f"{layer}.mlp.experts.{p}" for layer in layers for p in ("down_proj", "gate_up_proj")]
        assert any(m.endswith("mlp.shared_expert.up_proj") for m in modules)
        assert f"{len(config['target_parameters'])} expert parameters" in printed
    else:
        assert not config["target_parameters"] and any(m.endswith("mlp.gate_proj") for m in modules)
