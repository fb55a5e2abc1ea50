"""Tiny random transformers Qwen3.5 VLMs for tests (`Qwen3_5ForConditionalGeneration` and the MoE one), written by
transformers' own config classes and `save_pretrained`, shaped like the qwen3.5-vl-tiny variants' language model."""

from __future__ import annotations

import torch

# qwen3.5-vl-tiny's language model: G G * G, partial rotary (half of 16), interleaved MRoPE sections (2, 1, 1)
TEXT = dict(vocab_size=264, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})
MOE_TEXT = {**{k: v for k, v in TEXT.items() if k != "intermediate_size"}, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
# the special tokens at the top of the tiny vocabulary
TOKENS = dict(image_token_id=263, video_token_id=262, vision_start_token_id=260, vision_end_token_id=261)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2)


def reference_vlm(moe: bool = False, text: dict | None = None, tied: bool = False):
    """A random Qwen3.5 VLM in fp32 whose every tensor is away from its initial value: the zero-centered norms
    (1 + w), the gated delta net's output norm (w), A_log and dt_bias all matter, so mixing them up shows.
    `tied`: the output layer is the embedding (Qwen3.5's smallest models)."""
    import transformers

    if moe:
        config = transformers.Qwen3_5MoeConfig(text_config=text or MOE_TEXT, vision_config=VISION,
                                               tie_word_embeddings=tied, **TOKENS)
        cls = transformers.Qwen3_5MoeForConditionalGeneration
    else:
        config = transformers.Qwen3_5Config(text_config=text or TEXT, vision_config=VISION, tie_word_embeddings=tied,
                                            **TOKENS)
        cls = transformers.Qwen3_5ForConditionalGeneration
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not tensor.is_floating_point():
                continue
            if name.endswith("linear_attn.norm.weight"):
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                tensor.normal_(0.0, 0.3)  # zero-centered: applied as 1 + w
            elif name.endswith(("A_log", "dt_bias")):
                tensor.normal_(0.0, 0.5)
            else:
                tensor.normal_(0.0, 0.08)
    return model


def save_reference(folder, moe: bool = False, text: dict | None = None, tied: bool = False):
    model = reference_vlm(moe, text, tied)
    model.save_pretrained(folder, max_shard_size="300KB")
    return model, folder
