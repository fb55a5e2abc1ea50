"""Qwen3.5 VL: a hybrid language model of gated delta net (linear attention) and gated full attention layers, dense
or MoE, on megatron-core; the vision tower and its patch merger fill the `images` slot (vision.py), their tokens
injected at the `<|image_pad|>` placeholders, which take 3-D multimodal RoPE positions (positions.py). See
README.md for the architecture and how it maps onto megatron-core's modules.

One family (`Qwen35Settings`), variants that differ only in their defaults: the released shapes, and tiny ones for
tests and CPU smoke runs.
"""

from __future__ import annotations

from mimo import LANGUAGE, Encoder, ModuleShape, Provider, hookimpl

from .settings import ENCODER, IMAGES, Qwen35Settings, interleaved_pattern

__all__ = ["ENCODER", "IMAGES", "Qwen35Settings", "TINY", "MOE_TINY", "VARIANTS"]

# Tiny: both layer kinds (G G * G), small widths, a 264-id vocabulary (UTF-8 bytes and chat markers fit); a
# two-block tower of 8-pixel patches merged 2 x 2, images of 32^2 to 64^2 pixels (4 to 16 LLM tokens).
TINY_VISION = dict(vision_depth=2, vision_hidden_size=32, vision_intermediate_size=64, vision_heads=2,
                   vision_position_embeddings=64, patch_size=8, min_pixels=32 * 32, max_pixels=64 * 64)
TINY = dict(layer_pattern="GG*G", hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
            rotary_percent=0.5, mrope_section=(2, 1, 1), linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, ffn_hidden_size=128, vocab_size=264, seq_length=128,
            rotary_base=10000.0, **TINY_VISION)
MOE_TINY = dict(TINY, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                moe_shared_expert_intermediate_size=48)

# Released shapes (language model). 9B: transformers' Qwen3_5TextConfig defaults ("Qwen3.5-9B style"); 27B: the
# published model card (64 layers 3:1, hidden 5120, 24 query / 4 key-value heads of 256, MLP 17408) -- its gated
# delta net head counts are not confirmed here (16 key / 48 value heads of 128 assumed); 35B-A3B: transformers'
# Qwen3_5MoeTextConfig defaults. rope_theta 1e7 as the released configs have (transformers' default is 1e4).
# The vision tower of every released size: transformers' Qwen3_5VisionConfig defaults (27 blocks of 1152, 16 heads,
# MLP 4304, 16-pixel patches merged 2 x 2, a 48 x 48 position grid; the settings' defaults), its output the LLM's
# hidden size; the 27B's and 35B-A3B's towers are not confirmed here against their released configs. The image
# placeholder is <|image_pad|>, 248056.
RELEASED = dict(image_token_id=248056)
DENSE_9B = dict(layer_pattern=interleaved_pattern(32), **RELEASED)
DENSE_27B = dict(layer_pattern=interleaved_pattern(64), hidden_size=5120, num_attention_heads=24, num_query_groups=4,
                 ffn_hidden_size=17408, linear_num_value_heads=48, **RELEASED)
MOE_35B_A3B = dict(layer_pattern=interleaved_pattern(40), hidden_size=2048, num_attention_heads=16,
                   num_query_groups=2, num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=512,
                   moe_shared_expert_intermediate_size=512, **RELEASED)

VARIANTS = [
    Provider("qwen3.5-vl-9b", "Qwen3.5 9B VLM: 27-block vision tower + 32-layer hybrid (gated delta net 3:1 "
             "gated attention) dense LLM", Qwen35Settings, DENSE_9B),
    Provider("qwen3.5-vl-27b", "Qwen3.5 27B VLM: vision tower + 64-layer hybrid dense LLM, hidden 5120 "
             "(delta-net heads unconfirmed)", Qwen35Settings, DENSE_27B),
    Provider("qwen3.5-vl-35b-a3b", "Qwen3.5 35B-A3B VLM: vision tower + 40-layer hybrid MoE LLM, 256 experts "
             "(top 8) and a shared expert", Qwen35Settings, MOE_35B_A3B),
    Provider("qwen3.5-vl-tiny", "Qwen3.5 architecture at toy size (dense), for tests and CPU smoke runs",
             Qwen35Settings, TINY),
    Provider("qwen3.5-vl-moe-tiny", "Qwen3.5 MoE architecture at toy size, for tests and CPU smoke runs",
             Qwen35Settings, MOE_TINY),
]


@hookimpl
def register_providers():
    return VARIANTS


@hookimpl
def model_shape(settings: Qwen35Settings):
    from .counts import parameter_counts, vision_count

    s, counts, vision = settings, parameter_counts(settings), vision_count(settings)
    return {IMAGES: ModuleShape(s.vision_depth, s.vision_hidden_size, s.vision_heads, num_query_groups=s.vision_heads,
                                num_parameters=vision, num_active_parameters=vision),
            LANGUAGE: ModuleShape(s.num_layers, s.hidden_size, s.num_attention_heads,
                                  num_query_groups=s.num_query_groups, num_experts=s.num_experts or None,
                                  vocab_size=s.vocab_size, num_parameters=counts.total,
                                  num_active_parameters=counts.active)}


@hookimpl
def build_encoders(settings: Qwen35Settings, ctx):
    """The vision tower and its patch merger (the modality's input projection), their tokens replacing the image
    placeholders."""
    from .tokens import image_token_id
    from .vision import vision_submodules_spec

    s = settings
    spec = vision_submodules_spec(s, ctx, IMAGES, ENCODER, init_method_std=s.init_method_std, dropout=s.dropout)
    return {IMAGES: Encoder(spec=spec, placeholder_token_id=image_token_id(s))}


@hookimpl
def build_language_model(settings: Qwen35Settings, ctx):
    from .model import language_spec

    return language_spec(settings, ctx)


@hookimpl
def data_provider(settings: Qwen35Settings, ctx):
    from .data import data_provider as batches

    return batches(settings, ctx)


@hookimpl
def concat_encoder_inputs(settings: Qwen35Settings, modality, inputs):
    """--encoder-pass step: the micro-batches' images one after another (the tower attends within each)."""
    from .image_grid import GridImages

    return {encoder: GridImages.concat([i[encoder] for i in inputs]) for encoder in inputs[0]}


@hookimpl
def prompt_format(settings: Qwen35Settings):
    from .data import prompt_format as format_of

    return format_of(settings)


@hookimpl
def lora_targets(settings: Qwen35Settings):
    """The attention and gated delta net projections and the MLPs (routed and shared experts in MoE models)."""
    mlp = ["experts", "shared_experts"] if settings.is_moe else ["linear_fc1", "linear_fc2"]
    return {LANGUAGE: ["linear_qkv", "linear_proj", "in_proj", "out_proj", *mlp],
            IMAGES: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}


@hookimpl
def module_memory(settings: Qwen35Settings):
    from .memory import module_memory as memory_of

    return memory_of(settings)


@hookimpl
def model_flops(settings: Qwen35Settings):
    from .flops import forward_flops

    return forward_flops(settings)


@hookimpl
def sample_flops(settings: Qwen35Settings, tokens: int, image_patches: list[int]):
    from .flops import sample_flops as flops_of

    return flops_of(settings, tokens, image_patches)


@hookimpl
def hf_settings(hf_config: dict, part: str):
    from .hf.vlm import hf_settings as settings_of

    return settings_of(hf_config, part)


@hookimpl
def hf_tensor_map(settings: Qwen35Settings, hf_config: dict, part: str):
    from .hf.vlm import hf_tensor_map as tensor_map

    return tensor_map(settings, hf_config, part)


@hookimpl
def hf_export_check(settings: Qwen35Settings):
    from .hf.vlm import hf_export_check as check

    return check(settings)


@hookimpl
def hf_export(settings: Qwen35Settings):
    from .hf.vlm import hf_export as export

    return export(settings)
