"""Nemotron MoE VLM: a RADIO vision encoder, a linear projection and a hybrid Mamba / MoE / attention LLM.

One family (`NemotronVLMSettings`), five variants that differ only in their defaults: the 20- and 54-layer
models of Megatron-LM's recipe, the 52-layer one of the released Nemotron 3 Nano, a mid-size 20-layer model for one GPU, and a tiny one for tests and CPU smoke runs. See README.md for
the backends, parameter names and Nemotron checkpoints.
"""

from __future__ import annotations

from mimo import LANGUAGE, KernelConfigs, ModuleShape, Provider, hookimpl, module_prefix

from .settings import ENCODER, IMAGES, PATTERN_20L, PATTERN_52L, PATTERN_54L, NemotronVLMSettings

__all__ = ["ENCODER", "IMAGES", "NemotronVLMSettings", "VARIANTS"]

# The mid-size model: the 20-layer pattern at reduced width and expert count, the full RADIO encoder. In bf16 on
# one 80 GB H100 (local backend) micro-batch 4 of 2048 tokens peaks at 68 GB; micro-batch 8 does not fit.
MID = dict(hidden_size=1536, num_attention_heads=16, kv_channels=96, num_experts=32,
           moe_ffn_hidden_size=768, moe_shared_expert_intermediate_size=1536, mamba_num_heads=32,
           mamba_num_groups=4, projection_hidden_size=6144, max_patches=2048, seq_length=2048)

# The tiny model: every layer kind, few experts, a two-layer RADIO, small images; a tenth of a second per step
# on a CPU. No position-embedding jitter, so that every parallel layout computes exactly the same thing. Its 264
# token ids hold UTF-8 bytes and the chat template's markers: `--data` works without a tokenizer folder.
TINY = dict(
    vision_layers=2, vision_hidden_size=32, vision_heads=2, vision_ffn_hidden_size=64, class_tokens=2,
    max_image_size=256, image_size=64, min_patches=16, max_patches=64, projection_hidden_size=64,
    hybrid_pattern="M*EME", hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
    num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=64,
    mamba_num_heads=4, mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=16, vocab_size=264, seq_length=256,
    num_classes=8, cpe_augmentation=False,
)

VARIANTS = [
    Provider("nemotron-moe-vlm-20l", "Nemotron MoE VLM, 20-layer hybrid LLM (hidden 2688, 128 experts) + RADIO-H",
             NemotronVLMSettings, {"hybrid_pattern": PATTERN_20L}),
    Provider("nemotron-moe-vlm-54l", "Nemotron MoE VLM, 54-layer hybrid LLM (hidden 2688, 128 experts) + RADIO-H",
             NemotronVLMSettings, {"hybrid_pattern": PATTERN_54L}),
    # The released Nemotron 3 Nano 30B-A3B's published LLM shape: the 52-layer pattern, 2 key/value heads.
    Provider("nemotron-moe-vlm-52l", "Nemotron MoE VLM with the released Nemotron 3 Nano 30B-A3B LLM (52 layers, "
             "2 KV heads) + RADIO-H", NemotronVLMSettings, {"hybrid_pattern": PATTERN_52L, "num_query_groups": 2}),
    Provider("nemotron-moe-vlm-mid", "Nemotron MoE VLM at reduced width (20 layers, hidden 1536, 32 experts), "
             "for one 80 GB GPU", NemotronVLMSettings, MID),
    Provider("nemotron-moe-vlm-tiny", "Nemotron MoE VLM architecture at toy size, for tests and CPU smoke runs",
             NemotronVLMSettings, TINY),
]


@hookimpl
def register_providers():
    return VARIANTS


@hookimpl
def model_shape(settings: NemotronVLMSettings):
    from .counts import parameter_counts

    counts = parameter_counts(settings)
    s = settings
    return {
        IMAGES: ModuleShape(s.vision_layers, s.vision_hidden_size, s.vision_heads, num_query_groups=s.vision_heads,
                            num_parameters=counts[IMAGES].total, num_active_parameters=counts[IMAGES].active),
        LANGUAGE: ModuleShape(s.num_layers, s.hidden_size, s.num_attention_heads,
                                num_query_groups=s.num_query_groups,
                                num_experts=s.num_experts if "E" in s.hybrid_pattern else 0,
                                vocab_size=s.vocab_size,
                                num_parameters=counts[LANGUAGE].total,
                                num_active_parameters=counts[LANGUAGE].active),
    }


@hookimpl
def build_encoders(settings: NemotronVLMSettings, ctx):
    from .model import vision_spec

    return {IMAGES: vision_spec(settings, ctx)}


@hookimpl
def build_language_model(settings: NemotronVLMSettings, ctx):
    from .model import language_spec

    return language_spec(settings, ctx)


@hookimpl
def data_provider(settings: NemotronVLMSettings, ctx):
    from .data import energon_batches, synthetic_batches

    return energon_batches(settings, ctx) if ctx.data_path else synthetic_batches(settings, ctx)


@hookimpl
def concat_encoder_inputs(settings, modality, inputs):
    from mimo.plugins.data import concat_clips

    from .data import image_mode

    mode = image_mode(settings)
    return {encoder: concat_clips(mode, [i[encoder] for i in inputs]) for encoder in inputs[0]}


@hookimpl
def prompt_format(settings: NemotronVLMSettings):
    from .data import prompt_format as format_of

    return format_of(settings)


@hookimpl
def frozen_parameters(settings: NemotronVLMSettings):
    """stage1 trains the projection only, stage2 everything but the vision encoder, stage3 everything. RADIO's
    video patch embedder (omni checkpoints) is frozen unless the synthetic data feeds it video (video_frames):
    fed none, it would only decay."""
    frozen = {
        "stage1": [f"{module_prefix(IMAGES)}encoders.", module_prefix(LANGUAGE)],
        "stage2": [f"{module_prefix(IMAGES)}encoders."],
        "stage3": [],
    }[settings.stage]
    if settings.video_temporal_patch_size > 1 and settings.stage == "stage3" and not settings.video_frames:
        frozen = [f"{module_prefix(IMAGES)}encoders.{ENCODER}.video_embedder."]
    return frozen


@hookimpl
def lora_targets(settings: NemotronVLMSettings):
    """The LLM's attention, Mamba projections and experts (routed and shared), RADIO's attention and MLPs and the
    projection: what the issue's one-GPU fine-tuning adapts."""
    pattern = settings.hybrid_pattern
    language = (["linear_qkv", "linear_proj"] if "*" in pattern else []) + (
        ["in_proj", "out_proj"] if "M" in pattern else []) + (["experts", "shared_experts"] if "E" in pattern else [])
    return {
        LANGUAGE: language,
        IMAGES: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        "projection": ["all"],
    }


@hookimpl
def module_memory(settings: NemotronVLMSettings):
    from .memory import module_memory as memory_of

    return memory_of(settings)


@hookimpl
def model_flops(settings: NemotronVLMSettings):
    from .flops import forward_flops

    return forward_flops(settings)


@hookimpl
def sample_flops(settings: NemotronVLMSettings, tokens: int, image_patches: list[int]):
    from .flops import sample_flops as flops_of

    return flops_of(settings, tokens, image_patches)


@hookimpl
def kernel_configs(settings: NemotronVLMSettings):
    """The family's autotuned Triton kernels and the choices recorded for them on the GPUs in kernel_configs/ (one
    JSON per GPU)."""
    from .kernel_tables import MODULES, recorded_tables

    return KernelConfigs(MODULES, tuple(recorded_tables()))


@hookimpl
def hf_settings(hf_config: dict, part: str):
    from .hf.vlm import hf_settings as settings_of

    return settings_of(hf_config, part)


@hookimpl
def hf_tensor_map(settings: NemotronVLMSettings, hf_config: dict, part: str):
    from .hf.vlm import hf_tensor_map as tensor_map

    return tensor_map(settings, hf_config, part)


@hookimpl
def hf_export_check(settings: NemotronVLMSettings):
    from .hf.vlm import hf_export_check as check

    return check(settings)


@hookimpl
def hf_export(settings: NemotronVLMSettings):
    from .hf.vlm import hf_export as export

    return export(settings)


@hookimpl
def load_pretrained(settings: NemotronVLMSettings, model, directory):
    from .checkpoint import is_nemotron_checkpoint, load_nemotron_checkpoint

    if not is_nemotron_checkpoint(directory):
        return None
    load_nemotron_checkpoint(model, directory)
    return True
