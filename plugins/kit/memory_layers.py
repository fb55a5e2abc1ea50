"""Per-layer memory formulas for the layer kinds megatron-core builds, for providers' `module_memory` hooks.

Activations follow Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models"): each
tensor an operation keeps for its backward, per token, adjusted for what megatron-core actually keeps:
flash / TE / SDPA attention keeps q, k, v, its output and a softmax statistic per head, never the [s, s] scores;
dropout at 0 keeps no mask; a squared-ReLU or GeLU MLP keeps the activation's input (or output) and the second
GEMM's input. `v` is the bytes of one activation value (2 in bf16, 4 in fp32); norm statistics are fp32.

Selective recomputation (`core_attn`, and with transformer-engine `layernorm` and `moe_act`, what mimo turns on)
drops the attention's own output and statistics, the separate norms' outputs and the routed experts' activation
output; full recomputation keeps each layer's input only and rebuilds one layer at a time in backward (its full
activations are then the `working` memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory import LayerMemory, TokenBytes, Weights

STATS = 8  # a norm's fp32 mean and reciprocal std per token (RMSNorm keeps one; counted as two, it is small)


@dataclass(frozen=True)
class Kernels:
    """How a backend's modules keep activations.

    fp32_norm: the norm is computed on an fp32 copy of its input, which it keeps (mimo's local fused norm).
    fused_norm: the norm is fused into the next linear layer (TE's LayerNormLinear, mimo's local stand-in): a
        selective `layernorm` recompute has nothing separate to drop.
    te: transformer-engine's modules (selective recompute then also drops separate norms and MoE activations).
    attention_copy: the attention output is copied before the output projection, so both copies are kept
        (mimo's SDPA module on packed THD sequences writes each sequence's output into a new buffer).
    """

    fp32_norm: bool = False
    fused_norm: bool = True
    te: bool = False
    attention_copy: bool = False


def _norm_linear(h: int, v: int, kernels: Kernels) -> float:
    """A norm followed by a linear layer: the norm's input (in fp32 for fp32_norm) and statistics, and the
    normalized tensor the linear layer keeps."""
    return (4 * h if kernels.fp32_norm else h * v) + STATS + h * v


def _full(kept_none, h: int):
    """Full recomputation keeps the layer's input; backward rebuilds the layer's activations."""
    def kept(mode: str, v: int) -> TokenBytes:
        return TokenBytes(replicated=h * v) if mode == "full" else kept_none(mode, v)

    def working(mode: str, v: int) -> TokenBytes:
        return kept_none("none", v) if mode == "full" else TokenBytes()

    return kept, working


def attention(h: int, heads: int, groups: int, head_dim: int, kernels: Kernels, *, bias: bool = False,
              qkv_bias: bool = False, rope: bool = False, norm_bias: bool = False) -> LayerMemory:
    """Pre-norm self-attention with its output projection (and the residual add, which keeps nothing)."""
    q, kv = heads * head_dim, groups * head_dim
    weights = Weights(tp=h * (q + 2 * kv) + q * h + ((q + 2 * kv) if qkv_bias else 0),
                      replicated=h * (2 if norm_bias else 1) + (h if bias else 0))

    def kept_none(mode: str, v: int) -> TokenBytes:
        # q, k and v are views of the qkv projection's output, which therefore stays whole
        if kernels.te:  # TE's attention takes contiguous copies of q, k and v: the projection's output is freed
            tp = (q + 2 * kv) * v
        else:  # grouped-query attention reshapes q out of them (a copy), unless RoPE makes new q and k anyway
            tp = (q + 2 * kv) * v + ((q + kv) * v if rope else (q * v if groups != heads else 0))
        # the attention output, kept by the output projection; recomputed under selective, the core attention
        # keeps neither its softmax statistic (logsumexp, fp32) nor a copy of the output of its own
        own = 0 if mode == "selective" else 4 * heads + (q * v if kernels.attention_copy else 0)
        return TokenBytes(replicated=_norm_linear(h, v, kernels), tp=tp + q * v + own)

    kept, working = _full(kept_none, h)
    return LayerMemory("attention", weights, kept, working)


def mlp(h: int, ffn: int, kernels: Kernels, *, bias: bool = False, norm_bias: bool = False,
        kind: str = "mlp") -> LayerMemory:
    """Pre-norm MLP without a gate (GeLU or squared ReLU): the activation keeps its input or output, the second
    linear layer its input."""
    weights = Weights(tp=2 * h * ffn + (ffn if bias else 0),
                      replicated=h * (2 if norm_bias else 1) + (h if bias else 0))

    def kept_none(mode: str, v: int) -> TokenBytes:
        return TokenBytes(replicated=_norm_linear(h, v, kernels), tp=2 * ffn * v)

    kept, working = _full(kept_none, h)
    return LayerMemory(kind, weights, kept, working)


def transformer(h: int, heads: int, groups: int, head_dim: int, ffn: int, kernels: Kernels, *, bias: bool,
                rope: bool = False, kind: str = "transformer") -> LayerMemory:
    """A GPT or ViT layer: attention and MLP, each pre-norm (LayerNorm with bias when `bias`)."""
    a = attention(h, heads, groups, head_dim, kernels, bias=bias, qkv_bias=bias, rope=rope, norm_bias=bias)
    m = mlp(h, ffn, kernels, bias=bias, norm_bias=bias)

    def kept_none(mode: str, v: int) -> TokenBytes:
        return a.kept(mode, v) + m.kept(mode, v)

    kept, working = _full(kept_none, h)
    return LayerMemory(kind, a.weights + m.weights, kept, working)


def moe(h: int, experts: int, topk: int, expert_ffn: int, shared_ffn: int, kernels: Kernels,
        stacked_experts: bool = False) -> LayerMemory:
    """Pre-norm routed experts (no gate, no bias) with a shared expert; the router in fp32.

    Each token reaches `topk` experts: the dispatched copies (the experts' input) and their activations count
    top-k times, on whichever EP rank holds the expert; balanced routing gives every rank the same share. The
    routing probabilities weight the activation (megatron-core's grouped experts, mimo's grouped GEMMs), so the
    experts' outputs are not kept (a snapshot of the slice at its peak: the input, fc1's output and the activation,
    0.25 + 0.17 + 0.17 GiB per MoE layer at 8192 tokens, nothing more)."""
    weights = Weights(tp=2 * h * shared_ffn, replicated=h + experts * h, expert=experts * 2 * h * expert_ffn)

    def kept_none(mode: str, v: int) -> TokenBytes:
        norm = h * v + STATS if not (mode == "selective" and kernels.te) else STATS  # separate norm: recomputed
        router = 4 * experts * 4  # logits, scores, their sigmoid's output and the top-k mask, fp32
        act = 2 * expert_ffn * v if not (mode == "selective" and kernels.te) else expert_ffn * v
        routed = topk * (h * v + act + 4)  # input, activations, probability
        return TokenBytes(replicated=h * v + norm + router, tp=2 * shared_ffn * v, expert=routed)

    def wgrad_inputs(mode: str, v: int) -> TokenBytes:
        # the routed copies fc1 reads and, unless recomputed, the activations fc2 reads
        if mode == "full":
            return TokenBytes()
        return TokenBytes(expert=topk * (h * v + (0 if mode == "selective" and kernels.te else expert_ffn * v)))

    kept, working = _full(kept_none, h)
    return LayerMemory("moe", weights, kept, working, wgrad_inputs, stacked_experts=stacked_experts)


def mamba(h: int, heads: int, head_dim: int, groups: int, state: int, conv_kernel: int, kernels: Kernels, *,
          fused_scan: bool, chunk: int = 128) -> LayerMemory:
    """A Mamba-2 mixer: fused input norm and projection to z, x, B, C, dt; causal depthwise convolution; the
    SSD scan; gated RMSNorm; output projection.

    fused_scan: mamba-ssm's fused split-conv1d-scan kernel, which keeps the projection's output, the scan's output
    and the norm's statistics. Otherwise the chunked scan in PyTorch (chunk length `chunk`), which keeps its fp32
    intermediates: the per-chunk [chunk x chunk] decay and C B^T matrices and the states between chunks."""
    d_inner, gn = heads * head_dim, groups * state
    proj = 2 * d_inner + 2 * gn + heads
    conv = d_inner + 2 * gn
    weights = Weights(tp=h * proj + conv * (conv_kernel + 1) + 3 * heads + d_inner + d_inner * h, replicated=h)

    def kept_none(mode: str, v: int) -> TokenBytes:
        if fused_scan:
            tp = proj * v + d_inner * v + d_inner * v + 4 * groups  # zxBCdt, scan output, norm output, rstd
        else:
            tp = (proj * v  # in_proj's output (z, dt and the conv input are views of it)
                  + 2 * conv * v  # the padded conv input and the conv output (SiLU's input)
                  + 2 * heads * 4  # dt in fp32 and softplus's input
                  + (2 * d_inner + 2 * gn + 2 * heads) * 4  # the scan's fp32 x, x*dt, B, C, dt, cumulative decay
                  + 2 * heads * chunk * 4  # exp(segsum) decay [heads, chunk, chunk] per chunk, and its mask
                  + groups * chunk * 4  # C B^T [groups, chunk, chunk] per chunk
                  + 3 * heads * head_dim * state * 4 / chunk  # chunk states: own, carried, and their products
                  + 2 * d_inner * 4  # y in fp32 and the skip term
                  + 2 * d_inner * 4 + d_inner * v)  # gate (fp32 z, SiLU) and norm in fp32, out_proj input
        return TokenBytes(replicated=_norm_linear(h, v, kernels), tp=tp)

    kept, working = _full(kept_none, h)
    return LayerMemory("mamba", weights, kept, working)


def embedding(vocab: int, h: int, *, positions: int = 0) -> LayerMemory:
    """Vocab-parallel word embeddings (and a replicated position table): backward needs the token ids (int64);
    the looked-up rows are the next layer's input, counted there."""
    return LayerMemory("embedding", Weights(tp=vocab * h, replicated=positions * h),
                       lambda mode, v: TokenBytes(replicated=8))


def output(vocab: int, h: int, *, final_norm_bias: bool = False, kernels: Kernels = Kernels(),
           fused_loss: bool = False) -> LayerMemory:
    """Final norm, vocab-parallel output layer and cross-entropy. megatron-core's loss keeps the exponentiated
    logits in fp32 (backward turns them into the gradient in place); while it runs, the logits in the activations'
    dtype (in backward, their gradient) exist besides. The H100 peaks in docs/verification.md check this term: it
    dominates a 131k-vocabulary run under full recomputation. `fused_loss` (transformer-engine's fused
    cross-entropy, run in place by kit/in_place_loss.py): the loss writes the gradient into the logits themselves,
    in their dtype, and nothing else of vocabulary size exists, in forward or backward (the slice's H100 peak fell
    by that copy, 51.3 to 49.4 GiB; a transformer-engine without `overwrite_input` keeps one more copy)."""
    weights = Weights(tp=vocab * h, replicated=h * (2 if final_norm_bias else 1))

    def kept(mode: str, v: int) -> TokenBytes:
        return TokenBytes(replicated=_norm_linear(h, v, kernels), tp=(v if fused_loss else 4) * vocab)

    def working(mode: str, v: int) -> TokenBytes:
        return TokenBytes() if fused_loss else TokenBytes(tp=vocab * v)  # the logits, or in backward their gradient

    return LayerMemory("output", weights, kept, working)
