"""Forward FLOPs per sample (2 per multiply-add) of both modules, for the loop's TFLOP/s and MFU.

Counted: every matrix multiply a token passes through (active experts only), attention scores and context over
the whole sequence (Megatron's convention), the depthwise convolution and the chunked SSD scan of the Mamba
layers as `mamba_mixer.ssd_scan` computes it. Dynamic-resolution images draw their patch count log-uniformly from
[min_patches, max_patches] (see `data.py`), so the encoder's share is the expectation over that draw.
"""

from __future__ import annotations

import math

from mimo import LANGUAGE

from .settings import NemotronVLMSettings

SSD_CHUNK = 128  # mamba_mixer's chunk size


def mamba(s: NemotronVLMSettings) -> float:
    h, heads, p, n, g = s.hidden_size, s.mamba_num_heads, s.mamba_head_dim, s.mamba_state_dim, s.mamba_num_groups
    d_inner, bc = heads * p, 2 * g * n
    projections = 2 * h * (2 * d_inner + bc + heads) + 2 * d_inner * h
    conv = 2 * (d_inner + bc) * s.mamba_conv_kernel
    chunks = math.ceil(s.seq_length / SSD_CHUNK)
    # C B^T within a chunk, its decayed product with x, each chunk's end state, the carry across chunks, and
    # the carried-in state's contribution: per token.
    scan = (2 * SSD_CHUNK * n * g + 2 * SSD_CHUNK * p * heads + 2 * p * n * heads
            + 2 * (chunks + 1) * p * n * heads / SSD_CHUNK + 2 * n * p * heads)
    return projections + conv + scan


def attention(s: NemotronVLMSettings) -> float:
    h, d = s.hidden_size, s.kv_channels
    projections = 2 * h * (s.num_attention_heads + 2 * s.num_query_groups) * d + 2 * s.num_attention_heads * d * h
    return projections + 4 * s.seq_length * s.num_attention_heads * d


def moe(s: NemotronVLMSettings) -> float:
    h = s.hidden_size
    return 2 * h * s.num_experts + 4 * h * s.moe_shared_expert_intermediate_size \
        + s.moe_router_topk * 4 * h * s.moe_ffn_hidden_size


def mlp(s: NemotronVLMSettings) -> float:
    return 4 * s.hidden_size * s.ffn_hidden_size


LAYER_FLOPS = {"M": mamba, "*": attention, "E": moe, "-": mlp}


def language(s: NemotronVLMSettings) -> float:
    per_token = 2 * s.hidden_size * s.vocab_size + sum(LAYER_FLOPS[symbol](s) for symbol in s.hybrid_pattern)
    return s.seq_length * per_token


def patch_moments(s: NemotronVLMSettings) -> tuple[float, float]:
    """E[patches] and E[patches^2] of one image."""
    if not s.dynamic_resolution:
        p = (s.image_size // s.patch_size) ** 2
        return float(p), float(p * p)
    lo, hi = s.min_patches, s.max_patches
    if lo == hi:
        return float(lo), float(lo * lo)
    span = math.log(hi / lo)
    return (hi - lo) / span, (hi * hi - lo * lo) / (2 * span)


def vision(s: NemotronVLMSettings) -> float:
    """One image: patch embedding, RADIO layers over patches + class tokens, projection of the shuffled tokens."""
    h, f = s.vision_hidden_size, s.vision_ffn_hidden_size
    mean, mean_sq = patch_moments(s)
    c = s.class_tokens
    tokens, tokens_sq = mean + c, mean_sq + 2 * c * mean + c * c  # E[T] and E[T^2], T = patches + class tokens
    per_token_layer = 2 * (4 * h * h + 2 * h * f)
    encoder = 2 * 3 * s.patch_size ** 2 * h * mean + s.vision_layers * (per_token_layer * tokens + 4 * h * tokens_sq)
    out = s.vision_output_size
    per_output_token = 2 * out * s.hidden_size if s.projection == "affine" else \
        2 * out * s.projection_hidden_size + 2 * s.projection_hidden_size * s.hidden_size
    return encoder + per_output_token * mean / s.shuffle_factor


def forward_flops(s: NemotronVLMSettings) -> dict[str, float]:
    from .settings import IMAGES

    return {IMAGES: s.image_probability * vision(s), LANGUAGE: float(language(s))}
