"""mock-vlm's `module_memory`: its ViT + projection and its GPT as layers of megatron-core's kinds."""

from __future__ import annotations

from mimo.plugins import LANGUAGE, LayerMemory, ModuleMemory, TokenBytes, Weights
from mimo.plugins.kit import memory_layers as ml
from mimo.plugins.kit.te_extras import te_extras_enabled

from .model import IMAGES, _ffn, resolve_backend


def _backend(settings) -> str:
    """An explicit backend is estimated as asked, also where it cannot run (a plan made off the GPU machines)."""
    return settings.backend if settings.backend != "auto" else resolve_backend("auto")


def kernels(settings) -> ml.Kernels:
    """te: norms fused into the next linear layer, TE attention. local: torch norms, mimo's SDPA module or
    megatron-core's unfused attention (attention=local: the scores are kept)."""
    if _backend(settings) == "te":
        return ml.Kernels(fused_norm=True, te=True)
    return ml.Kernels(fused_norm=False)


def _scores(settings, heads: int, tokens: int) -> LayerMemory:
    """megatron-core's unfused DotProductAttention (backend local, attention=local) keeps the softmax output and
    its input, [heads, tokens] per token."""
    unfused = _backend(settings) == "local" and settings.attention == "local"
    return LayerMemory("scores", Weights(),
                       lambda mode, v: TokenBytes(tp=2 * heads * tokens * v if unfused and mode == "none" else 0))


def _with_scores(layer: LayerMemory, scores: LayerMemory) -> LayerMemory:
    def kept(mode, v):
        return layer.kept(mode, v) + scores.kept(mode, v)

    def working(mode, v):
        return layer.working(mode, v) + (scores.kept("none", v) if mode == "full" else TokenBytes())

    return LayerMemory(layer.kind, layer.weights, kept, working)


def module_memory(settings) -> dict[str, ModuleMemory]:
    s, k = settings, kernels(settings)
    vh, h = s.vision_hidden_size, s.hidden_size
    patches, pixels = s.image_tokens, 3 * s.patch_size ** 2
    vit_layer = _with_scores(ml.transformer(vh, s.vision_heads, s.vision_heads, vh // s.vision_heads,
                                            _ffn(s, vh), k, bias=True, kind="vit"),
                             _scores(s, s.vision_heads, patches))
    patch_embedder = LayerMemory(  # conv (weight, bias), position table, the ViT's one LayerNorm
        "patch embedding", Weights(replicated=pixels * vh + vh + patches * vh + 2 * vh),
        lambda mode, v: TokenBytes(replicated=pixels * v + vh * v))  # the pixels and the embedded patches
    if s.projection == "mlp":
        projection = LayerMemory("projection", Weights(tp=vh * h + h + h * h, replicated=h),
                                 lambda mode, v: TokenBytes(replicated=vh * v, tp=2 * h * v))
    else:
        projection = LayerMemory("projection", Weights(tp=vh * h + h), lambda mode, v: TokenBytes(replicated=vh * v))
    gpt_layer = _with_scores(ml.transformer(h, s.num_attention_heads, s.num_attention_heads,
                                            h // s.num_attention_heads, _ffn(s, h), k, bias=True, rope=True),
                             _scores(s, s.num_attention_heads, s.seq_length))
    return {
        IMAGES: ModuleMemory(layers=(vit_layer,) * s.vision_layers,
                             tokens_per_sample=s.images_per_sample * patches if s.image_probability > 0 else 0,
                             first=patch_embedder, last=projection,
                             tokens_per_image_token=patches / s.image_tokens),  # one tile a placeholder per patch
        LANGUAGE: ModuleMemory(layers=(gpt_layer,) * s.num_layers, tokens_per_sample=s.seq_length,
                                 first=ml.embedding(s.vocab_size, h),
                                 last=ml.output(s.vocab_size, h, final_norm_bias=True, fused_loss=(
                                     _backend(s) == "te" and s.fused_cross_entropy and te_extras_enabled()))),
    }
