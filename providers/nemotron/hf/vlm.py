"""Hugging Face checkpoints of the Nemotron VLM family, for the provider's hooks: the omni VLM (transformers'
`nemotron_h_omni`) as a whole model, or a VLM assembled from parts, `nemotron_h` for the LLM and `radio` for the
encoder (the projector then starts from the provider's initialization).

The omni checkpoint's image path and LLM map onto the MimoModel's dist-checkpoint keys:

    vision_model.*      RADIO         modality_submodules.images.encoders.radio.*        (hf/radio.py)
    mlp1.*              projector     modality_submodules.images.input_projections.0.*   (hf/nemotron_h_omni.py)
    language_model.*    NemotronH     language_model.*                                   (hf/nemotron_h.py)

The audio branch (`audio_tower.*`, `embed_audio.*`) has no place in this provider: import leaves it out, export
writes a config without one.
"""

from __future__ import annotations

from dataclasses import replace

from mimo import LANGUAGE, module_prefix
from mimo.errors import UsageError
from mimo.plugins.kit.tensor_map import HFExport, LoadedModule, TensorMap

from . import nemotron_h, nemotron_h_omni, radio
from ..settings import ENCODER, IMAGES, NemotronVLMSettings

OMNI = "nemotron_h_omni"
PARTS = {"nemotron_h": "language", "radio": "vision"}
LANGUAGE_PREFIX = module_prefix(LANGUAGE)
ENCODER_PREFIX = f"{module_prefix(IMAGES)}encoders.{ENCODER}."
PROJECTION_PREFIX = f"{module_prefix(IMAGES)}input_projections.0."
HF_LANGUAGE, HF_VISION = "language_model.", "vision_model."
AUDIO_PREFIXES = ("audio_tower.", "embed_audio.")
VIDEO_EMBEDDER = f"{HF_VISION}{radio.MODEL}patch_generator.video_embedder.weight"
INFLATED_FRAMES = 2  # the video embedder an export synthesizes for a RADIO that has none
# What the omni model is, for the settings that shape it differently: setting -> the omni model's value.
OMNI_SETTINGS = {"pixel_shuffle": True, "projection": "mlp", "projection_norm": True, "dynamic_resolution": True,
                 "image_grid": "scaled"}


# ------------------------------------------------------------------------------------------------------ import


def hf_settings(hf_config: dict, part: str) -> dict | None:
    """The settings a config.json determines for `part`: the whole omni model ("model"), the LLM ("language",
    nemotron_h) or the encoder ("vision", radio); None for a model type the provider does not read there."""
    model_type = hf_config.get("model_type")
    if part == "language":
        return nemotron_h.config_fields(hf_config) if model_type == "nemotron_h" else None
    if part == "vision":
        return radio.config_fields(hf_config) if model_type == "radio" else None
    if model_type in PARTS:
        flag = {"language": "llm", "vision": "vision"}[PARTS[model_type]]
        raise UsageError(f"Hugging Face config model_type={model_type!r} is only the "
                         f"{'language model' if flag == 'llm' else 'vision encoder'} of a VLM: give it as a part "
                         f"(mimo run --pretrained-{flag} DIR, or mimo ckpt import-hf --{flag} DIR OUT)")
    if model_type != OMNI:
        return None
    fields = nemotron_h_omni.config_fields(hf_config)
    fields.update(nemotron_h.config_fields(nemotron_h_omni.text_config(hf_config)))
    image_token = hf_config.get("image_token_id", hf_config.get("img_context_token_id"))  # released: img_context_...
    if image_token is not None:
        fields["image_token_id"] = image_token
    return fields


def hf_tensor_map(settings: NemotronVLMSettings, hf_config: dict, part: str) -> TensorMap | None:
    model_type = hf_config.get("model_type")
    if part == "language" and model_type == "nemotron_h":
        return nemotron_h.tensor_map(vars(settings)).prefixed(LANGUAGE_PREFIX, "")
    if part == "vision" and model_type == "radio":
        return radio.tensor_map(settings, hf_config).prefixed(ENCODER_PREFIX, "")
    if part == "model" and model_type == OMNI:
        return omni_map(settings, nemotron_h_omni._vision_config(hf_config))
    return None


def omni_map(s: NemotronVLMSettings, vision_config: dict | None = None) -> TensorMap:
    """The whole model in an omni checkpoint; `vision_config` (import) checks RADIO's non-weights against it."""
    language = nemotron_h.tensor_map(vars(s)).prefixed(LANGUAGE_PREFIX, HF_LANGUAGE)
    # The omni model's RADIO has no input conditioner: its image processor normalizes, as mimo's data path does.
    vision = radio.tensor_map(s, vision_config, conditioner=False).prefixed(ENCODER_PREFIX, HF_VISION)
    projector = nemotron_h_omni.projector_map().prefixed(PROJECTION_PREFIX, "")
    out = language.merged(vision, projector)
    out.ignored += AUDIO_PREFIXES
    return out


# ------------------------------------------------------------------------------------------------------ export


def hf_export_check(settings: NemotronVLMSettings) -> dict:
    """{setting: (this value, the omni model's)} of every setting the omni model cannot express."""
    return {name: (getattr(settings, name), value) for name, value in OMNI_SETTINGS.items()
            if getattr(settings, name) != value}


def hf_export(settings: NemotronVLMSettings) -> HFExport:
    """The omni folder of these settings: config.json, the map, and the tokenizer and processor files."""
    from .processor import processor_files

    if refused := hf_export_check(settings):
        raise UsageError("the Nemotron omni model has " + ", ".join(f"{k}={v[1]!r}" for k, v in refused.items()))
    tmap, notes = omni_map(settings), []
    if settings.video_temporal_patch_size < 2:
        # Released C-RADIO encoders have no video embedder; the omni config requires one. Frames that are all the
        # same image embed as that image.
        tmap.derived[VIDEO_EMBEDDER] = ((ENCODER_PREFIX + "embedder.weight",),
                                        radio.inflated_video_embedder(INFLATED_FRAMES))
        notes.append(f"RADIO has no video patch embedder: the export makes one of {INFLATED_FRAMES} frames from the "
                     f"image embedder (video_temporal_patch_size {INFLATED_FRAMES}; images are unaffected)")
    return HFExport(omni_config(settings), tmap, processor_files(settings), notes,
                    lambda name: loaded_module(name, settings.vision_hidden_size))


def loaded_module(name: str, vision_hidden: int) -> tuple[LoadedModule, ...] | str:
    """The modules of the omni model transformers loads that hold the exported weight `name` (a PEFT adapter's
    targets), or why none does: each part's own renaming under its prefix."""
    if name in nemotron_h_omni.LOADED_PROJECTOR:
        return (LoadedModule(nemotron_h_omni.LOADED_PROJECTOR[name]),)
    for prefix, part in ((HF_LANGUAGE, nemotron_h.loaded_module),
                         (HF_VISION, lambda n: radio.loaded_module(n, vision_hidden))):
        if name.startswith(prefix):
            held = part(name.removeprefix(prefix))
            return held if isinstance(held, str) else tuple(replace(m, path=prefix + m.path) for m in held)
    return "no linear module of the omni model transformers loads"


def omni_config(s: NemotronVLMSettings) -> dict:
    """The omni config.json of settings the omni model can express (hf_export_check)."""
    mlp_ratio = s.vision_ffn_hidden_size / s.vision_hidden_size
    if int(s.vision_hidden_size * mlp_ratio) != s.vision_ffn_hidden_size:
        raise UsageError(f"setting vision_ffn_hidden_size={s.vision_ffn_hidden_size}: RADIO's MLP is "
                         f"int(hidden_size x mlp_ratio) wide, which no ratio makes of {s.vision_hidden_size}")
    frames = s.video_temporal_patch_size if s.video_temporal_patch_size > 1 else INFLATED_FRAMES
    vision = {**radio.vision_config(s), "video_temporal_patch_size": frames}
    from ..tokens import image_token_id

    return dict(model_type=OMNI, architectures=["NemotronH_Omni_Reasoning_V3"], vision_config=vision,
                text_config=nemotron_h.text_config(s), audio_config=None, downsample_ratio=0.5,
                projector_hidden_size=s.projection_hidden_size, vision_hidden_size=s.vision_hidden_size,
                video_temporal_patch_size=frames, image_token_id=image_token_id(s))
