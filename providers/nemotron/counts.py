"""Parameter counts of both modules as functions of the settings (`model_shape` reports them before anything is
built). Tests check them against built models; the counts are the same for both backends (TE's fused and grouped
modules hold the same tensors as their local counterparts).

"Active" parameters are those one token passes through: everything except the routed experts it is not sent
to, i.e. each MoE layer counts its router, shared expert and `moe_router_topk` of its experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from mimo import LANGUAGE

from .settings import IMAGES, NemotronVLMSettings


@dataclass(frozen=True)
class Count:
    total: int
    active: int

    def __add__(self, other: "Count") -> "Count":
        return Count(self.total + other.total, self.active + other.active)


def _dense(n: int) -> Count:
    return Count(n, n)


def _norm_linear(norm: int, fan_in: int, fan_out: int, bias: bool) -> int:
    """A linear layer with an input norm (TE's LayerNormLinear): norm weight(s), weight, optional bias."""
    return norm * fan_in + fan_in * fan_out + (fan_out if bias else 0)


def mamba_layer(s: NemotronVLMSettings) -> Count:
    h, d_inner = s.hidden_size, s.mamba_num_heads * s.mamba_head_dim
    bc = 2 * s.mamba_num_groups * s.mamba_state_dim  # the B and C projections
    in_proj = _norm_linear(1, h, 2 * d_inner + bc + s.mamba_num_heads, bias=False)  # z, x, B, C, dt
    conv = (d_inner + bc) * (s.mamba_conv_kernel + 1)  # depthwise weight and bias over x, B, C
    per_head = 3 * s.mamba_num_heads  # dt_bias, A_log, D
    return _dense(in_proj + conv + per_head + d_inner + d_inner * h)  # + gated norm weight, out_proj


def attention_layer(s: NemotronVLMSettings) -> Count:
    h, d = s.hidden_size, s.kv_channels
    qkv = _norm_linear(1, h, (s.num_attention_heads + 2 * s.num_query_groups) * d, bias=False)
    return _dense(qkv + s.num_attention_heads * d * h)


def moe_layer(s: NemotronVLMSettings) -> Count:
    h = s.hidden_size
    expert = 2 * h * s.moe_ffn_hidden_size  # fc1 and fc2, no gating, no bias
    always = h + s.num_experts * h + 2 * h * s.moe_shared_expert_intermediate_size  # norm, router, shared expert
    return Count(always + s.num_experts * expert, always + s.moe_router_topk * expert)


def mlp_layer(s: NemotronVLMSettings) -> Count:
    h = s.hidden_size
    return _dense(_norm_linear(1, h, s.ffn_hidden_size, bias=False) + s.ffn_hidden_size * h)  # fc1, fc2


LAYER_COUNTS = {"M": mamba_layer, "*": attention_layer, "E": moe_layer, "-": mlp_layer}


def language(s: NemotronVLMSettings) -> Count:
    count = _dense(2 * s.vocab_size * s.hidden_size + s.hidden_size)  # embedding, output layer, final norm
    for symbol in s.hybrid_pattern:
        count = count + LAYER_COUNTS[symbol](s)
    return count


def vision_encoder(s: NemotronVLMSettings) -> int:
    """RADIO: patch embedder (no bias), optional video patch embedder, CPE position grid, class tokens,
    pre-norm layers with biases."""
    h, f = s.vision_hidden_size, s.vision_ffn_hidden_size
    layer = (_norm_linear(2, h, 3 * h, bias=True) + h * h + h  # LayerNorm + qkv, proj
             + _norm_linear(2, h, f, bias=True) + f * h + h)  # LayerNorm + fc1, fc2
    frames = s.video_temporal_patch_size
    embedders = 3 * s.patch_size ** 2 * h * (1 + (frames if frames > 1 else 0))
    return embedders + s.max_grid ** 2 * h + s.class_tokens * h + s.vision_layers * layer


def projection(s: NemotronVLMSettings) -> int:
    """One linear layer, or an MLP (optionally with an RMSNorm on its input), from the (pixel-shuffled) encoder
    token into the LLM; no biases."""
    if s.projection == "affine":
        return s.vision_output_size * s.hidden_size
    norm = s.vision_output_size if s.has_projection_norm else 0
    return norm + s.vision_output_size * s.projection_hidden_size + s.projection_hidden_size * s.hidden_size


def parameter_counts(s: NemotronVLMSettings) -> dict[str, Count]:
    """`{IMAGES: encoder + projection, "language": LLM}`, total and active."""
    return {IMAGES: _dense(vision_encoder(s) + projection(s)), LANGUAGE: language(s)}
