"""mock-vlm: a small ViT, a projection and a GPT built from megatron-core, trained on synthetic image+text data or,
with `--data`, on an energon dataset of any format docs/data.md lists (e.g. one `mimo data sample` writes).

Small and fast (50 iterations in well under two minutes on two CPU cores): for smoke runs and tests.
"""

from __future__ import annotations

from mimo import LANGUAGE, ModuleShape, Provider, hookimpl, module_prefix

from .settings import IMAGES, MockVLMSettings


@hookimpl
def register_providers():
    return [Provider("mock-vlm", "Small ViT + GPT on synthetic data, for smoke runs and tests", MockVLMSettings)]


@hookimpl
def model_shape(settings: MockVLMSettings):
    from .model import parameter_counts

    counts = parameter_counts(settings)
    return {
        IMAGES: ModuleShape(settings.vision_layers, settings.vision_hidden_size, settings.vision_heads,
                            num_parameters=counts[IMAGES]),
        LANGUAGE: ModuleShape(settings.num_layers, settings.hidden_size, settings.num_attention_heads,
                                vocab_size=settings.vocab_size, num_parameters=counts[LANGUAGE]),
    }


@hookimpl
def build_encoders(settings: MockVLMSettings, ctx):
    from .model import vision_spec

    return {IMAGES: vision_spec(settings, ctx)}


@hookimpl
def build_language_model(settings: MockVLMSettings, ctx):
    from .model import language_spec

    return language_spec(settings, ctx)


@hookimpl
def data_provider(settings: MockVLMSettings, ctx):
    from .data import energon_batches, synthetic_batches

    return energon_batches(settings, ctx) if ctx.data_path else synthetic_batches(settings, ctx)


@hookimpl
def frozen_parameters(settings: MockVLMSettings):
    frozen = [f"{module_prefix(IMAGES)}encoders."] if settings.freeze_vision else []
    return frozen + ([module_prefix(LANGUAGE)] if settings.freeze_language else [])


@hookimpl
def lora_targets(settings: MockVLMSettings):
    """Attention and MLP of both transformers, and the projection."""
    layers = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    return {LANGUAGE: layers, IMAGES: layers, "projection": ["all"]}


@hookimpl
def module_memory(settings: MockVLMSettings):
    from .memory import module_memory as memory_of

    return memory_of(settings)


@hookimpl
def model_flops(settings: MockVLMSettings):
    from .model import forward_flops

    return forward_flops(settings)


@hookimpl
def sample_flops(settings: MockVLMSettings, tokens: int, image_patches: list[int]):
    from .model import sample_flops as flops_of

    return flops_of(settings, tokens, image_patches)


@hookimpl
def concat_encoder_inputs(settings, modality, inputs):
    from mimo.plugins.data import FixedTiles

    # the ViT sees each image on its own (one tile each): micro-batches' images stack into one batch
    return {encoder: FixedTiles.concat([i[encoder] for i in inputs]) for encoder in inputs[0]}


@hookimpl
def prompt_format(settings: MockVLMSettings):
    from .data import prompt_format as format_of

    return format_of(settings)
