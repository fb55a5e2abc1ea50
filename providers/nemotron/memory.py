"""The Nemotron VLM family's `module_memory`: RADIO + projection and the hybrid LLM, layer by layer as
`hybrid_pattern` lays them out, for either backend."""

from __future__ import annotations

import math

from mimo.plugins import LANGUAGE, LayerMemory, ModuleMemory, TokenBytes, Weights
from mimo.plugins.kit import memory_layers as ml
from mimo.plugins.kit.te_extras import te_extras_enabled

from .settings import IMAGES, NemotronVLMSettings
from .specs import resolve_backend, uses_grouped_mm


def _backend(s: NemotronVLMSettings) -> str:
    # an explicit backend is estimated as asked, also where it cannot run (a plan made off the GPU machines)
    return s.backend if s.backend != "auto" else resolve_backend("auto")


def kernels(s: NemotronVLMSettings) -> ml.Kernels:
    """te: transformer-engine's fused norm + linear and attention, mamba-ssm's fused scan. local: mimo's norm +
    linear (the norm in fp32 on a copy of its input) and SDPA module."""
    if _backend(s) == "te":
        return ml.Kernels(fused_norm=True, te=True)
    return ml.Kernels(fp32_norm=True)


def llm_layers(s: NemotronVLMSettings) -> list[LayerMemory]:
    k = kernels(s)
    fused = k.te
    kinds = {
        "M": lambda: ml.mamba(s.hidden_size, s.mamba_num_heads, s.mamba_head_dim, s.mamba_num_groups,
                              s.mamba_state_dim, s.mamba_conv_kernel, k, fused_scan=fused),
        "E": lambda: ml.moe(s.hidden_size, s.num_experts, s.moe_router_topk, s.moe_ffn_hidden_size,
                            s.moe_shared_expert_intermediate_size, k,
                            stacked_experts=uses_grouped_mm(s.expert_gemm, _backend(s))),
        "*": lambda: ml.attention(s.hidden_size, s.num_attention_heads, s.num_query_groups, s.kv_channels, k),
        "-": lambda: ml.mlp(s.hidden_size, s.ffn_hidden_size, k),
    }
    made = {symbol: make() for symbol, make in kinds.items() if symbol in s.hybrid_pattern}
    return [made[symbol] for symbol in s.hybrid_pattern]


def _patch_embedder(s: NemotronVLMSettings) -> LayerMemory:
    """RADIO's patch embedder(s), position grid and class tokens; keeps the patches' pixels and embeddings."""
    h, pixels = s.vision_hidden_size, 3 * s.patch_size ** 2
    frames = s.video_temporal_patch_size
    weights = Weights(replicated=pixels * h * (1 + (frames if frames > 1 else 0)) + s.max_grid ** 2 * h
                      + s.class_tokens * h)
    return LayerMemory("patch embedding", weights, lambda mode, v: TokenBytes(replicated=pixels * v + 2 * h * v))


def _projection(s: NemotronVLMSettings) -> LayerMemory:
    """Per encoder token (before pixel shuffle): the shuffled features, and the MLP's hidden activations."""
    out, h, shuffle = s.vision_output_size, s.hidden_size, s.shuffle_factor
    if s.projection == "affine":
        return LayerMemory("projection", Weights(tp=out * h), lambda mode, v: TokenBytes(replicated=out * v / shuffle))
    ph = s.projection_hidden_size
    norm = out if s.has_projection_norm else 0
    return LayerMemory("projection", Weights(tp=out * ph + ph * h, replicated=norm),
                       lambda mode, v: TokenBytes(replicated=(out + norm) * v / shuffle, tp=2 * ph * v / shuffle))


def vision_tokens(s: NemotronVLMSettings) -> int:
    """Encoder tokens of the largest media a sample carries: each image and video tubelet (encoder_sequences) of
    max_patches (dynamic resolution; patches_per_image when set) or a tile's patches, plus the class tokens."""
    patches = s.max_patches if s.dynamic_resolution else (s.image_size // s.patch_size) ** 2
    return s.encoder_sequences * ((s.patches_per_image or patches) + s.class_tokens)


def mean_vision_tokens(s: NemotronVLMSettings) -> float:
    """Encoder tokens of an average sample of the synthetic data: media with probability image_probability, the
    patch counts of their images and frames log-uniform in [min_patches, max_patches] (data.py), plus the class
    tokens."""
    if not s.dynamic_resolution or s.max_patches == s.min_patches or s.patches_per_image:
        return s.image_probability * vision_tokens(s)
    patches = (s.max_patches - s.min_patches) / math.log(s.max_patches / s.min_patches)
    return s.image_probability * s.encoder_sequences * (patches + s.class_tokens)
def tokens_per_image_token(s: NemotronVLMSettings) -> float:
    """RADIO's tokens per image placeholder of the LLM's row, at most: the patches pixel shuffle merges into one
    placeholder, plus an image's class tokens over the placeholders of the smallest image (packed rows of many
    small images carry the most class tokens)."""
    smallest = s.patches_per_image or (s.min_patches if s.dynamic_resolution else (s.image_size // s.patch_size) ** 2)
    return s.shuffle_factor + s.class_tokens / max(smallest // s.shuffle_factor, 1)


def module_memory(s: NemotronVLMSettings) -> dict[str, ModuleMemory]:
    k, vh = kernels(s), s.vision_hidden_size
    if not k.te and s.dynamic_resolution:  # packed images: mimo's SDPA module writes a new output buffer
        k = ml.Kernels(fp32_norm=True, attention_copy=True)
    vit = ml.transformer(vh, s.vision_heads, s.vision_heads, vh // s.vision_heads, s.vision_ffn_hidden_size, k,
                         bias=True, kind="vit")
    return {
        IMAGES: ModuleMemory(layers=(vit,) * s.vision_layers,
                             tokens_per_sample=vision_tokens(s) if s.image_probability > 0 else 0,
                             first=_patch_embedder(s), last=_projection(s),
                             mean_tokens_per_sample=mean_vision_tokens(s) if s.image_probability > 0 else 0,
                             tokens_per_image_token=tokens_per_image_token(s)),
        LANGUAGE: ModuleMemory(layers=tuple(llm_layers(s)), tokens_per_sample=s.seq_length,
                                 first=ml.embedding(s.vocab_size, s.hidden_size),
                                 last=ml.output(s.vocab_size, s.hidden_size,
                                                fused_loss=k.te and s.fused_cross_entropy and te_extras_enabled())),
    }
