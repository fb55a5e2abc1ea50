"""Forward FLOPs per sample (2 per multiply-add) of both modules, for the loop's TFLOP/s and MFU.

Counted: every matrix multiply a token passes through (active experts only), attention scores and context over
the whole sequence (Megatron's convention), the depthwise convolution and the chunked SSD scan of the Mamba
layers as `mamba_mixer.ssd_scan` computes it. A sample with media (image_probability) carries images_per_sample
images and a video of video_frames frames, which RADIO encodes as one sequence per group of
video_temporal_patch_size frames; dynamic-resolution images and frames draw their patch count log-uniformly from
[min_patches, max_patches] (see `data.py`; patches_per_image: exactly that many), so the encoder's share is the
expectation over that draw (the grids it lands on take 4-7% more at full size; tests/unit/test_nemotron_workload.py).

`sample_flops` is the same count for one real sample (a `--data` run's): its own length (attention and the scan
within it) and each of its images at its own patch count; at the synthetic shape it gives `forward_flops`.
"""

from __future__ import annotations

import math

from mimo import LANGUAGE

from .settings import NemotronVLMSettings

SSD_CHUNK = 128  # mamba_mixer's chunk size


def mamba(s: NemotronVLMSettings, tokens: int) -> float:
    """Per token of a sequence of `tokens`."""
    h, heads, p, n, g = s.hidden_size, s.mamba_num_heads, s.mamba_head_dim, s.mamba_state_dim, s.mamba_num_groups
    d_inner, bc = heads * p, 2 * g * n
    projections = 2 * h * (2 * d_inner + bc + heads) + 2 * d_inner * h
    conv = 2 * (d_inner + bc) * s.mamba_conv_kernel
    chunks = math.ceil(tokens / SSD_CHUNK)
    # C B^T within a chunk, its decayed product with x, each chunk's end state, the carry across chunks, and
    # the carried-in state's contribution: per token.
    scan = (2 * SSD_CHUNK * n * g + 2 * SSD_CHUNK * p * heads + 2 * p * n * heads
            + 2 * (chunks + 1) * p * n * heads / SSD_CHUNK + 2 * n * p * heads)
    return projections + conv + scan


def attention(s: NemotronVLMSettings, tokens: int) -> float:
    """Per token of a sequence of `tokens` (scores and context over the whole sequence: Megatron's convention)."""
    h, d = s.hidden_size, s.kv_channels
    projections = 2 * h * (s.num_attention_heads + 2 * s.num_query_groups) * d + 2 * s.num_attention_heads * d * h
    return projections + 4 * tokens * s.num_attention_heads * d


def moe(s: NemotronVLMSettings, tokens: int) -> float:
    h = s.hidden_size
    return 2 * h * s.num_experts + 4 * h * s.moe_shared_expert_intermediate_size \
        + s.moe_router_topk * 4 * h * s.moe_ffn_hidden_size


def mlp(s: NemotronVLMSettings, tokens: int) -> float:
    return 4 * s.hidden_size * s.ffn_hidden_size


LAYER_FLOPS = {"M": mamba, "*": attention, "E": moe, "-": mlp}


def language(s: NemotronVLMSettings, tokens: int | None = None) -> float:
    """A sequence of `tokens` (default: seq_length)."""
    tokens = s.seq_length if tokens is None else tokens
    kinds = {symbol: LAYER_FLOPS[symbol](s, tokens) for symbol in set(s.hybrid_pattern)}  # each kind's once
    per_token = 2 * s.hidden_size * s.vocab_size + sum(kinds[symbol] for symbol in s.hybrid_pattern)
    return tokens * per_token


def patch_moments(s: NemotronVLMSettings) -> tuple[float, float]:
    """E[patches] and E[patches^2] of one image or video frame."""
    if not s.dynamic_resolution:
        p = (s.image_size // s.patch_size) ** 2
        return float(p), float(p * p)
    if s.fixed_grid is not None:  # patches_per_image: exact
        return float(s.patches_per_image), float(s.patches_per_image ** 2)
    lo, hi = s.min_patches, s.max_patches
    if lo == hi:
        return float(lo), float(lo * lo)
    span = math.log(hi / lo)
    return (hi - lo) / span, (hi * hi - lo * lo) / (2 * span)


def sequence(s: NemotronVLMSettings, frames: int = 1, patches: int | None = None) -> float:
    """One sequence RADIO encodes: patch embedding (of `frames` frames per patch: a video tubelet through the
    video embedder), RADIO layers over patches + class tokens, projection of the shuffled tokens; `patches`
    patches, or the expectation over the settings' draw."""
    h, f = s.vision_hidden_size, s.vision_ffn_hidden_size
    mean, mean_sq = patch_moments(s) if patches is None else (float(patches), float(patches * patches))
    c = s.class_tokens
    tokens, tokens_sq = mean + c, mean_sq + 2 * c * mean + c * c  # E[T] and E[T^2], T = patches + class tokens
    per_token_layer = 2 * (4 * h * h + 2 * h * f)
    encoder = 2 * frames * 3 * s.patch_size ** 2 * h * mean \
        + s.vision_layers * (per_token_layer * tokens + 4 * h * tokens_sq)
    out = s.vision_output_size
    per_output_token = 2 * out * s.hidden_size if s.projection == "affine" else \
        2 * out * s.projection_hidden_size + 2 * s.projection_hidden_size * s.hidden_size
    return encoder + per_output_token * mean / s.shuffle_factor


def vision(s: NemotronVLMSettings) -> float:
    """A sample with media: its images, then its video's tubelets (video_temporal_patch_size frames embedded at a
    time; without a video embedder every frame is an image)."""
    flops = s.images_per_sample * sequence(s) if s.images_per_sample else 0.0
    if s.video_frames:
        flops += s.video_sequences * sequence(s, s.video_temporal_patch_size)
    return flops


def forward_flops(s: NemotronVLMSettings) -> dict[str, float]:
    from .settings import IMAGES

    return {IMAGES: s.image_probability * vision(s), LANGUAGE: float(language(s))}


def sample_flops(s: NemotronVLMSettings, tokens: int, image_patches) -> dict[str, float]:
    """One sample of `tokens` LLM tokens whose images RADIO encodes as sequences of `image_patches` patches."""
    from .settings import IMAGES

    return {IMAGES: float(sum(sequence(s, 1, p) for p in image_patches)), LANGUAGE: float(language(s, tokens))}
