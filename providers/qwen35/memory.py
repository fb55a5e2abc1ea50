"""The Qwen3.5 family's `module_memory`: the language model layer by layer as `layer_pattern` lays it out. Each
layer is one TransformerLayer, its mixer (gated delta net or gated attention) and its MLP (SwiGLU or MoE): a part
is its weights and what it keeps per token without recomputation; full recomputation keeps the layer's input."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from mimo.plugins import LANGUAGE, LayerMemory, ModuleMemory, TokenBytes, Weights
from mimo.plugins.kit import memory_layers as ml
from mimo.plugins.kit.te_extras import te_extras_enabled

from .counts import swiglu
from .settings import IMAGES, Qwen35Settings
from .specs import resolve_backend, uses_grouped_mm

CHUNK = 64  # the gated delta rule's chunk


@dataclass(frozen=True)
class Part:
    kind: str
    weights: Weights
    kept: Callable[[str, int], TokenBytes]  # by recompute mode "none" or "selective"
    wgrad_inputs: Callable[[str, int], TokenBytes] | None = None
    stacked_experts: bool = False


def _backend(s: Qwen35Settings) -> str:
    # an explicit backend is estimated as asked, also where it cannot run (a plan made off the GPU machines)
    return s.backend if s.backend != "auto" else resolve_backend("auto")


def kernels(s: Qwen35Settings) -> ml.Kernels:
    return ml.Kernels(fused_norm=True, te=True) if _backend(s) == "te" else ml.Kernels(fp32_norm=True)


def _norm_input(h: int, v: int, k: ml.Kernels) -> float:
    """A fused norm + linear keeps the norm's input (an fp32 copy locally), its statistics and the normalized
    tensor."""
    return (4 * h if k.fp32_norm else h * v) + ml.STATS + h * v


def delta_net(s: Qwen35Settings, k: ml.Kernels) -> Part:
    """in_proj's output, the convolution's input and output, the rule's fp32 q k v beta g and its chunk
    matrices ([chunk, chunk] decay and solve per head), the gated norm's fp32 input and gate, out_proj's input."""
    h, heads = s.hidden_size, s.linear_num_value_heads
    kd, vd = s.linear_num_key_heads * s.linear_key_head_dim, heads * s.linear_value_head_dim
    proj, conv = 2 * kd + 2 * vd + 2 * heads, 2 * kd + vd
    weights = Weights(tp=h * proj + conv * s.linear_conv_kernel + 2 * heads + vd * h,
                      replicated=h + s.linear_value_head_dim)
    qk = 2 * heads * s.linear_key_head_dim  # q and k repeated to the value heads

    def kept(mode: str, v: int) -> TokenBytes:
        tp = proj * v + 2 * conv * v + (qk + vd + 2 * heads) * 4 + 3 * heads * CHUNK * 4 + 2 * vd * 4 + vd * v
        return TokenBytes(replicated=_norm_input(h, v, k), tp=tp)

    return Part("gated delta net", weights, kept)


def gated_attention(s: Qwen35Settings, k: ml.Kernels) -> Part:
    """megatron-core's attention plus its output gate (query-sized, from linear_qkv; sigmoid in fp32) and q/k
    norms (their outputs)."""
    base = ml.attention(s.hidden_size, s.num_attention_heads, s.num_query_groups, s.kv_channels, k, rope=True)
    q = s.num_attention_heads * s.kv_channels
    weights = base.weights + Weights(tp=s.hidden_size * q, replicated=2 * s.kv_channels)
    return Part("attention", weights, lambda mode, v: base.kept(mode, v) + TokenBytes(tp=q * v + q * 4 + 2 * q * v))


def swiglu_mlp(s: Qwen35Settings, k: ml.Kernels) -> Part:
    h, ffn = s.hidden_size, s.ffn_hidden_size
    # fc1's output (gate and up), fc2's input (the activation's product)
    return Part("mlp", Weights(tp=swiglu(h, ffn), replicated=h),
                lambda mode, v: TokenBytes(replicated=_norm_input(h, v, k), tp=3 * ffn * v))


def moe(s: Qwen35Settings, k: ml.Kernels) -> Part:
    """The kit's MoE formula plus what SwiGLU adds (fc1 twice as wide, routed and shared) and the shared expert's
    gate (a weight per hidden unit)."""
    h = s.hidden_size
    base = ml.moe(h, s.num_experts, s.moe_router_topk, s.moe_ffn_hidden_size, s.moe_shared_expert_intermediate_size,
                  k, stacked_experts=uses_grouped_mm(s.expert_gemm, _backend(s)))
    weights = Weights(tp=swiglu(h, s.moe_shared_expert_intermediate_size), replicated=2 * h + s.num_experts * h,
                      expert=s.num_experts * swiglu(h, s.moe_ffn_hidden_size))

    def kept(mode: str, v: int) -> TokenBytes:
        return base.kept(mode, v) + TokenBytes(tp=s.moe_shared_expert_intermediate_size * v,
                                               expert=s.moe_router_topk * s.moe_ffn_hidden_size * v)

    return Part("moe", weights, kept, base.wgrad_inputs, base.stacked_experts)


def layer(mixer: Part, mlp: Part, h: int) -> LayerMemory:
    """One TransformerLayer; under full recomputation it keeps its input and rebuilds the rest in backward."""
    def kept(mode: str, v: int) -> TokenBytes:
        return TokenBytes(replicated=h * v) if mode == "full" else mixer.kept(mode, v) + mlp.kept(mode, v)

    def working(mode: str, v: int) -> TokenBytes:
        return mixer.kept("none", v) + mlp.kept("none", v) if mode == "full" else TokenBytes()

    extra = {"wgrad_inputs": mlp.wgrad_inputs} if mlp.wgrad_inputs else {}
    return LayerMemory(f"{mixer.kind} + {mlp.kind}", mixer.weights + mlp.weights, kept, working,
                       stacked_experts=mlp.stacked_experts, **extra)


def vision_memory(s: Qwen35Settings) -> ModuleMemory:
    """The tower's blocks (ViT layers; mimo's SDPA module on packed images copies the attention output, and the
    tower runs megatron-core's local modules on either backend), the patch embedding with the position grid
    first, the patch merger last. A sample's patches: at most max_pixels' of one image and as many as its
    placeholders (which fit the sequence) hold."""
    from .data import largest_image_area

    vh, heads, m2 = s.vision_hidden_size, s.vision_heads, s.spatial_merge_size ** 2
    k = ml.Kernels(fp32_norm=True, attention_copy=True)
    block = ml.transformer(vh, heads, heads, vh // heads, s.vision_intermediate_size, k, bias=True, rope=True,
                           kind="vision block")
    row = 3 * s.temporal_patch_size * s.patch_size ** 2
    first = LayerMemory("patch embedding", Weights(replicated=row * vh + vh + s.vision_position_embeddings * vh),
                        lambda mode, v: TokenBytes(replicated=row * v + 2 * vh * v))
    merged = vh * m2
    # per patch: the norm's input and output, then fc1's output and GELU's (a merged token's share)
    # (fc1 column-parallel with its bias, fc2 row-parallel: its bias whole on every TP rank)
    last = LayerMemory("patch merger", Weights(tp=merged * merged + merged + merged * s.vision_output_size,
                                               replicated=2 * vh + s.vision_output_size),
                       lambda mode, v: TokenBytes(replicated=2 * vh * v + ml.STATS, tp=2 * vh * v))
    patches = min(s.max_pixels // s.patch_size ** 2, s.seq_length * m2)
    lo, hi = s.min_pixels, max(largest_image_area(s), s.min_pixels)  # the synthetic areas: log-uniform
    mean = s.images_per_sample * (hi - lo) / math.log(hi / lo) / s.patch_size ** 2 if hi > lo else \
        s.images_per_sample * lo / s.patch_size ** 2
    return ModuleMemory(layers=(block,) * s.vision_depth, tokens_per_sample=patches, first=first, last=last,
                        mean_tokens_per_sample=mean or None, tokens_per_image_token=float(m2))


def module_memory(s: Qwen35Settings) -> dict[str, ModuleMemory]:
    k, h = kernels(s), s.hidden_size
    mlp = moe(s, k) if s.is_moe else swiglu_mlp(s, k)
    kinds = {c: layer(delta_net(s, k) if c == "G" else gated_attention(s, k), mlp, h) for c in set(s.layer_pattern)}
    output = ml.output(s.vocab_size, h, kernels=k, fused_loss=k.te and te_extras_enabled())
    if s.tie_word_embeddings:  # the output layer reads the embedding's weight: only the final norm is its own
        output = LayerMemory(output.kind, Weights(replicated=h), output.kept, output.working)
    language = ModuleMemory(layers=tuple(kinds[c] for c in s.layer_pattern), tokens_per_sample=s.seq_length,
                            first=ml.embedding(s.vocab_size, h), last=output)
    return {IMAGES: vision_memory(s), LANGUAGE: language}
