"""mock-vlm's modules, as megatron-core specs: a SigLIP-style CLIPViTModel, an MLP projection, a GPTModel.

Backend `local` uses megatron-core's local layer specs, `te` its transformer-engine ones. Both draw the initial
weights in the same order from the same seed (norms start at one), so the two backends start from equal weights;
the parameter names differ (te fuses each norm into the following linear layer)."""

from __future__ import annotations

import copy

from megatron.core.models.gpt import GPTModel
import importlib.util

import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.mimo.submodules.vision import VisionModalitySubmodules
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.vit_layer_specs import (
    get_vit_layer_with_local_spec, get_vit_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from mimo import LANGUAGE, Encoder, SDPAttention
from mimo.plugins.kit.in_place_loss import InPlaceCrossEntropy
from mimo.plugins.kit.te_extras import te_extras_enabled

from .settings import IMAGES


class MockLanguageModel(InPlaceCrossEntropy, GPTModel):
    """megatron-core's GPTModel whose fused loss reuses the logits' buffer for their gradient (kit)."""


def _ffn(settings, hidden: int) -> int:
    return settings.ffn_hidden_size or 4 * hidden


def resolve_backend(requested: str) -> str:
    te_installed = importlib.util.find_spec("transformer_engine") is not None
    if requested == "auto":
        return "te" if te_installed and torch.cuda.is_available() else "local"
    if requested == "te" and not (te_installed and torch.cuda.is_available()):
        missing = "transformer-engine" if not te_installed else "a visible GPU"
        raise ValueError(f"backend 'te' needs {missing}; use backend=local (or auto)")
    return requested


def _kernels(backend: str, ctx) -> dict:
    """te: fused bias-dropout-add and RoPE. FP8 runs only through transformer-engine's layers."""
    if backend == "te":
        return {"bias_dropout_fusion": True, "apply_rope_fusion": True}
    for wanted, option in ((ctx.fp8 != "none", f"--fp8 {ctx.fp8}"), (ctx.cuda_graphs, "--cuda-graphs")):
        if wanted:
            raise ValueError(f"{option} needs backend te: --set backend=te (transformer-engine and a GPU)")
    return {}


def _fused_loss(settings, backend: str) -> dict:
    """te: transformer-engine's fused cross-entropy, which never materializes the fp32 logits (and, through
    MockLanguageModel, writes their gradient into them)."""
    if backend == "te" and settings.fused_cross_entropy and te_extras_enabled():
        return {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "te"}
    return {}


def _norm(backend: str):
    if backend == "te":
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return WrappedTorchNorm


def _layer_spec(local_spec: ModuleSpec, settings, te_spec=None) -> ModuleSpec:
    """megatron-core's TE layer spec (backend te), or its local one with SDPA as the core attention unless
    `attention=local`."""
    if te_spec is not None:
        return te_spec
    if settings.attention == "local":
        return local_spec
    spec = copy.deepcopy(local_spec)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def vision_spec(settings, ctx) -> Encoder:
    backend = resolve_backend(settings.backend)
    pgc = ctx.pg_collection(IMAGES)
    vit_config = ctx.transformer_config(
        IMAGES, num_layers=settings.vision_layers, hidden_size=settings.vision_hidden_size,
        num_attention_heads=settings.vision_heads, ffn_hidden_size=_ffn(settings, settings.vision_hidden_size),
        hidden_dropout=settings.dropout, attention_dropout=settings.dropout, **_kernels(backend, ctx),
    )
    projection_config = ctx.transformer_config(
        # The projection has no attention; its head count only has to suit the encoder's TP, like the ViT's.
        IMAGES, num_layers=1, hidden_size=settings.hidden_size, num_attention_heads=settings.vision_heads,
        ffn_hidden_size=settings.hidden_size, gated_linear_unit=False,
    )
    vit = ModuleSpec(
        module=CLIPViTModel,
        params=dict(
            transformer_config=vit_config,
            transformer_layer_spec=_layer_spec(get_vit_layer_with_local_spec(), settings,
                                               get_vit_layer_with_transformer_engine_spec() if backend == "te" else None),
            ln_pre_impl=_norm(backend), ln_post_impl=_norm(backend),
            model_subtype="siglip", add_class_token=False, class_token_len=0, patch_dim=settings.patch_size,
            img_h=settings.image_size, img_w=settings.image_size, pg_collection=pgc,
        ),
    )
    projection = ModuleSpec(
        module=MultimodalProjector,
        params=dict(
            config=projection_config,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            projector_type=settings.projection, input_size=settings.vision_hidden_size, pg_collection=pgc,
        ),
    )
    spec = ModuleSpec(
        module=VisionModalitySubmodules,
        params={"pg_collection": pgc},
        submodules={"encoders": {"vit": vit}, "input_projections": [projection]},
    )
    return Encoder(spec=spec, placeholder_token_id=settings.image_token_id)


def language_spec(settings, ctx) -> ModuleSpec:
    backend = resolve_backend(settings.backend)
    config = ctx.transformer_config(
        LANGUAGE, num_layers=settings.num_layers, hidden_size=settings.hidden_size,
        num_attention_heads=settings.num_attention_heads, ffn_hidden_size=_ffn(settings, settings.hidden_size),
        hidden_dropout=settings.dropout, attention_dropout=settings.dropout, **_kernels(backend, ctx),
        **_fused_loss(settings, backend),
    )
    if ctx.sequence_parallel and ctx.parallelism[LANGUAGE].tp > 1 and backend != "te":
        raise ValueError("--sequence-parallel needs backend te (megatron-core's torch norms do not split the "
                         "sequence): --set backend=te, or leave sequence parallelism off")
    te_spec = get_gpt_layer_with_transformer_engine_spec() if backend == "te" else None
    return ModuleSpec(
        module=MockLanguageModel,
        params=dict(
            config=config, transformer_layer_spec=_layer_spec(get_gpt_layer_local_spec(), settings, te_spec),
            vocab_size=settings.vocab_size, max_sequence_length=settings.seq_length, position_embedding_type="rope",
            scatter_embedding_sequence_parallel=False,  # MimoModel scatters the combined embeddings itself
            pre_process=ctx.is_first_stage(LANGUAGE), post_process=ctx.is_last_stage(LANGUAGE),
            pg_collection=ctx.pg_collection(LANGUAGE),
        ),
    )


def parameter_counts(settings) -> dict[str, int]:
    """Exact parameter counts of both modules, from their shapes (checked against built models in tests)."""
    def layers(n, h, ffn):  # qkv, proj, 2 layer norms, fc1, fc2 (all with biases)
        return n * (3 * h * h + 3 * h + h * h + h + 4 * h + h * ffn + ffn + ffn * h + h)

    vh, h = settings.vision_hidden_size, settings.hidden_size
    patches = settings.image_tokens
    vit = 3 * vh * settings.patch_size**2 + vh + patches * vh + 2 * vh + layers(
        settings.vision_layers, vh, _ffn(settings, vh))
    proj = (vh * h + h + h * h + h) if settings.projection == "mlp" else vh * h + h
    llm = 2 * settings.vocab_size * h + layers(settings.num_layers, h, _ffn(settings, h)) + 2 * h
    return {IMAGES: vit + proj, LANGUAGE: llm}


def _transformer(tokens, h, ffn, layers):
    """Forward FLOPs of `layers` transformer layers over one sequence: qkv + projection, MLP, attention scores and
    context."""
    return layers * (2 * tokens * (4 * h * h + 2 * h * ffn) + 4 * tokens * tokens * h)


def image_flops(settings, patches: int):
    """One image through the ViT (`patches` patches: one sequence) and the projection."""
    vh, h = settings.vision_hidden_size, settings.hidden_size
    vit = 2 * patches * 3 * settings.patch_size**2 * vh + _transformer(
        patches, vh, _ffn(settings, vh), settings.vision_layers)
    projection = 2 * patches * (vh * h + (h * h if settings.projection == "mlp" else 0))
    return vit + projection


def language_flops(settings, tokens: int):
    """One sequence of `tokens` through the GPT and its output layer."""
    h = settings.hidden_size
    return _transformer(tokens, h, _ffn(settings, h), settings.num_layers) + 2 * tokens * h * settings.vocab_size


def forward_flops(settings) -> dict[str, float]:
    """Forward matmul FLOPs per sample (2 per multiply-add), images weighted by how often a sample has them."""
    images = settings.image_probability * settings.images_per_sample
    return {IMAGES: images * image_flops(settings, settings.image_tokens),
            LANGUAGE: float(language_flops(settings, settings.seq_length))}


def sample_flops(settings, tokens: int, image_patches) -> dict[str, float]:
    """One sample of `tokens` tokens (attention within it) with images of `image_patches` patches each."""
    return {IMAGES: float(sum(image_flops(settings, p) for p in image_patches)),
            LANGUAGE: float(language_flops(settings, tokens))}
