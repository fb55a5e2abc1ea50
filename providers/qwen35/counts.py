"""Parameters of the language model, total and active per token (the routed experts a token reaches), counted
from the settings as megatron-core builds the layers (tests compare them with a built model)."""

from __future__ import annotations

from dataclasses import dataclass

from .settings import Qwen35Settings


@dataclass(frozen=True)
class Count:
    total: int
    active: int


def delta_net(s: Qwen35Settings) -> int:
    """in_proj (q, k, v, z, beta, alpha) with its fused input norm, the causal convolution over q k v (no bias),
    A_log and dt_bias per value head, the gated output norm (one value head wide) and out_proj."""
    kd = s.linear_num_key_heads * s.linear_key_head_dim
    vd = s.linear_num_value_heads * s.linear_value_head_dim
    in_proj = s.hidden_size * (2 * kd + 2 * vd + 2 * s.linear_num_value_heads) + s.hidden_size
    return (in_proj + (2 * kd + vd) * s.linear_conv_kernel + 2 * s.linear_num_value_heads
            + s.linear_value_head_dim + vd * s.hidden_size)


def attention(s: Qwen35Settings) -> int:
    """linear_qkv (queries, their output gates, keys, values) with its fused input norm, q and k norms, output
    projection."""
    q, kv = s.num_attention_heads * s.kv_channels, s.num_query_groups * s.kv_channels
    return s.hidden_size * (2 * q + 2 * kv) + s.hidden_size + 2 * s.kv_channels + q * s.hidden_size


def swiglu(h: int, ffn: int) -> int:
    return 3 * h * ffn


def mlp(s: Qwen35Settings) -> Count:
    """The dense MLP with its fused norm, or the MoE layer: norm, router, experts, shared expert and its gate."""
    h = s.hidden_size
    if not s.is_moe:
        n = swiglu(h, s.ffn_hidden_size) + h
        return Count(n, n)
    common = h + s.num_experts * h + swiglu(h, s.moe_shared_expert_intermediate_size) + h
    expert = swiglu(h, s.moe_ffn_hidden_size)
    return Count(common + s.num_experts * expert, common + s.moe_router_topk * expert)


def parameter_counts(s: Qwen35Settings) -> Count:
    h = s.hidden_size
    mixers = sum(delta_net(s) if c == "G" else attention(s) for c in s.layer_pattern)
    per_mlp = mlp(s)
    embeddings = s.vocab_size * h * (1 if s.tie_word_embeddings else 2) + h  # and the final norm
    return Count(embeddings + mixers + s.num_layers * per_mlp.total,
                 embeddings + mixers + s.num_layers * per_mlp.active)


def vision_tower(s: Qwen35Settings) -> int:
    """The patch embedding (a Conv3d's weight and bias), the learned position grid, and each block: two LayerNorms,
    fused qkv and output projection with biases, the MLP with biases."""
    h, ffn = s.vision_hidden_size, s.vision_intermediate_size
    embed = h * 3 * s.temporal_patch_size * s.patch_size ** 2 + h + s.vision_position_embeddings * h
    block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h)
    return embed + s.vision_depth * block


def patch_merger(s: Qwen35Settings) -> int:
    """The LayerNorm per patch, fc1 over a merged block (m^2 patches side by side) and fc2 to the LLM's width."""
    merged = s.vision_hidden_size * s.spatial_merge_size ** 2
    return 2 * s.vision_hidden_size + (merged * merged + merged) + (merged * s.vision_output_size
                                                                    + s.vision_output_size)


def vision_count(s: Qwen35Settings) -> int:
    return vision_tower(s) + patch_merger(s)
