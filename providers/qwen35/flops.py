"""Forward FLOPs per sample (2 per multiply-add) of the vision tower and the language model, for the loop's TFLOP/s
and MFU.

Counted: every matrix multiply a token passes through (active experts only, the router, the shared expert and its
gate), attention scores and context over the whole sequence (Megatron's convention), and in the gated delta net
layers the depthwise convolution and the chunked gated delta rule as megatron-core's torch_chunk_gated_delta_rule
computes it (chunks of 64: within a chunk the key products, the triangular solve's products and the outputs;
across chunks the state reads and updates). `sample_flops` is the same for one sample of its own length.
"""

from __future__ import annotations

import math

from mimo import LANGUAGE

from .counts import swiglu
from .settings import IMAGES, Qwen35Settings

CHUNK = 64  # the chunk of megatron-core's (and flash-linear-attention's) chunked gated delta rule


def delta_net(s: Qwen35Settings) -> float:
    """Per token."""
    h, heads = s.hidden_size, s.linear_num_value_heads
    dk, dv = s.linear_key_head_dim, s.linear_value_head_dim
    kd, vd = s.linear_num_key_heads * dk, heads * dv
    projections = 2 * h * (2 * kd + 2 * vd + 2 * heads) + 2 * vd * h
    conv = 2 * (2 * kd + vd) * s.linear_conv_kernel
    # per head and token: k k^T and q k^T rows of the chunk, the solve's products for v and k, the outputs within
    # the chunk, the state read (q and k against it) and the state update
    within = 2 * CHUNK * dk * 2 + 2 * CHUNK * (dv + dk) + 2 * CHUNK * dv
    across = 2 * dk * dv * 3
    return projections + conv + heads * (within + across)


def attention(s: Qwen35Settings, tokens: int) -> float:
    """Per token of a sequence of `tokens`."""
    h, d, heads = s.hidden_size, s.kv_channels, s.num_attention_heads
    projections = 2 * h * (2 * heads + 2 * s.num_query_groups) * d + 2 * heads * d * h
    return projections + 4 * tokens * heads * d


def mlp(s: Qwen35Settings) -> float:
    h = s.hidden_size
    if not s.is_moe:
        return 2 * swiglu(h, s.ffn_hidden_size)
    return (2 * h * s.num_experts + 2 * swiglu(h, s.moe_shared_expert_intermediate_size) + 2 * h
            + s.moe_router_topk * 2 * swiglu(h, s.moe_ffn_hidden_size))


def language(s: Qwen35Settings, tokens: int | None = None) -> float:
    tokens = s.seq_length if tokens is None else tokens
    mixer = {"G": delta_net(s), "*": attention(s, tokens)}
    per_token = 2 * s.hidden_size * s.vocab_size + sum(mixer[c] for c in s.layer_pattern) + s.num_layers * mlp(s)
    return float(tokens * per_token)


def image(s: Qwen35Settings, patches: float, patches_sq: float | None = None) -> float:
    """One image of `patches` patches through the tower (patch embedding, blocks with attention within the image:
    `patches_sq` is E[patches^2] for an expectation) and the patch merger (per merged token)."""
    h, ffn, m2 = s.vision_hidden_size, s.vision_intermediate_size, s.spatial_merge_size ** 2
    patches_sq = patches * patches if patches_sq is None else patches_sq
    embed = 2 * 3 * s.temporal_patch_size * s.patch_size ** 2 * h * patches
    blocks = s.vision_depth * (2 * (4 * h * h + 2 * h * ffn) * patches + 4 * h * patches_sq)
    merged = h * m2
    merger = 2 * (merged * merged + merged * s.vision_output_size) * patches / m2
    return embed + blocks + merger


def mean_image(s: Qwen35Settings) -> float:
    """An image of the synthetic data (data.py): its area log-uniform between min_pixels and the largest image, so
    E[patches] and E[patches^2] of that draw (grid rounding left out)."""
    from .data import largest_image_area

    lo, hi = s.min_pixels / s.patch_size ** 2, largest_image_area(s) / s.patch_size ** 2
    if hi <= lo:
        return image(s, lo)
    span = math.log(hi / lo)
    return image(s, (hi - lo) / span, (hi * hi - lo * lo) / (2 * span))


def forward_flops(s: Qwen35Settings) -> dict[str, float]:
    return {IMAGES: s.images_per_sample * mean_image(s), LANGUAGE: language(s)}


def sample_flops(s: Qwen35Settings, tokens: int, image_patches) -> dict[str, float]:
    """One sample of `tokens` LLM tokens whose images the tower reads as `image_patches` patches each."""
    return {IMAGES: float(sum(image(s, p) for p in image_patches)), LANGUAGE: language(s, tokens)}
