"""Hugging Face checkpoints of the Qwen3.5 family for the provider's hooks: a whole
`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` folder (`--pretrained HF_DIR`, `mimo ckpt
import-hf HF_DIR`, and what `mimo ckpt export-hf` writes), its language model alone (`--pretrained-llm`: the VLM
folder, or a `qwen3_5_text` / `qwen3_5_moe_text` `Qwen3_5ForCausalLM` one) or its vision tower alone
(`--pretrained-vision`: a VLM folder).

    model.language_model.*, lm_head.weight  the language model  language_model.*                     (qwen3_5.py)
    model.visual.* but merger.*             the vision tower    modality_submodules.images.encoders.visual.*
    model.visual.merger.*                   the patch merger    modality_submodules.images.input_projections.0.*

The image processor's fields (pixels, normalization) are not in config.json: an import keeps the settings' (Qwen's
processor defaults); an export writes them as preprocessor_config.json.
"""

from __future__ import annotations

import json
import re

from mimo import LANGUAGE, module_prefix
from mimo.errors import UsageError
from mimo.plugins.kit.tensor_map import HFExport, LoadedModule, TensorMap

from . import qwen3_5, vision
from ..settings import ENCODER, IMAGES, Qwen35Settings

VLM_TYPES = ("qwen3_5", "qwen3_5_moe")
LANGUAGE_PREFIX = module_prefix(LANGUAGE)
ENCODER_PREFIX = f"{module_prefix(IMAGES)}encoders.{ENCODER}."
MERGER_PREFIX = f"{module_prefix(IMAGES)}input_projections.0."
VISION_PREFIX = "model.visual."
TEXT_PREFIX = "model.language_model."


def _text_config(hf_config: dict) -> dict:
    text = dict(hf_config.get("text_config") or {})
    if not text:
        raise UsageError(f"Hugging Face config model_type={hf_config.get('model_type')!r} has no text_config")
    # the VLM's own tie_word_embeddings (top level) ties its lm_head, whatever text_config says
    text["tie_word_embeddings"] = hf_config.get("tie_word_embeddings", False)
    return text


def _vision_fields(hf_config: dict) -> dict:
    fields = vision.config_fields(hf_config.get("vision_config") or {})
    if hf_config.get("image_token_id") is not None:
        fields["image_token_id"] = hf_config["image_token_id"]
    return fields


def hf_settings(hf_config: dict, part: str) -> dict | None:
    model_type = hf_config.get("model_type")
    if part == "language":
        if model_type in qwen3_5.TEXT_TYPES:
            return qwen3_5.config_fields(hf_config)
        return qwen3_5.config_fields(_text_config(hf_config)) if model_type in VLM_TYPES else None
    if model_type not in VLM_TYPES:
        return None  # a text model's folder has no vision tower: --pretrained-llm reads it
    if part == "vision":
        return _vision_fields(hf_config)
    if part != "model":
        return None
    return {**qwen3_5.config_fields(_text_config(hf_config)), **_vision_fields(hf_config)}


def _language_map(settings: Qwen35Settings, text_prefix: str) -> TensorMap:
    return qwen3_5.tensor_map(vars(settings), text_prefix).prefixed(LANGUAGE_PREFIX, "")


def _vision_map(settings: Qwen35Settings) -> TensorMap:
    return vision.tower_map(settings).prefixed(ENCODER_PREFIX, VISION_PREFIX).merged(
        vision.merger_map(settings).prefixed(MERGER_PREFIX, VISION_PREFIX))


def hf_tensor_map(settings: Qwen35Settings, hf_config: dict, part: str) -> TensorMap | None:
    model_type = hf_config.get("model_type")
    if part == "language" and model_type in qwen3_5.TEXT_TYPES:
        return _language_map(settings, "model.")
    if model_type not in VLM_TYPES:
        return None
    if part == "language":
        tmap = _language_map(settings, TEXT_PREFIX)
        tmap.ignored += (VISION_PREFIX,)
        return tmap
    if part == "vision":
        tmap = _vision_map(settings)
        tmap.ignored += (TEXT_PREFIX, "lm_head.", "mtp.")
        return tmap
    if part == "model":
        return _language_map(settings, TEXT_PREFIX).merged(_vision_map(settings))
    return None


# ------------------------------------------------------------------------------------------------------ export


def hf_export_check(settings: Qwen35Settings) -> dict:
    """Every setting is a Qwen3.5 VLM config's: nothing refused."""
    return {}


def vlm_config(s: Qwen35Settings) -> dict:
    """The `Qwen3_5ForConditionalGeneration` (or MoE) config.json of settings `s`: what transformers reads back as
    the same model (hf_settings of it gives `s`'s fields)."""
    from ..tokens import image_token_id

    text = qwen3_5.text_config(s)
    text.pop("architectures")
    text.pop("tie_word_embeddings")
    moe = s.num_experts > 0
    vision_config = vision.vision_config(s)
    vision_config["model_type"] = "qwen3_5_moe_vision" if moe else "qwen3_5_vision"
    return dict(model_type=VLM_TYPES[int(moe)],
                architectures=["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
                text_config=text, vision_config=vision_config, image_token_id=image_token_id(s),
                tie_word_embeddings=s.tie_word_embeddings)


def hf_export(settings: Qwen35Settings) -> HFExport:
    """The whole VLM as a `Qwen3_5ForConditionalGeneration` (or MoE) folder, which transformers loads and
    `--pretrained` reads back, with the image processor's preprocessor_config.json."""
    tmap = _language_map(settings, TEXT_PREFIX).merged(_vision_map(settings))
    config = vlm_config(settings)
    files = {"preprocessor_config.json": json.dumps(vision.processor_config(settings), indent=2) + "\n"}
    note = (f"a {config['architectures'][0]} folder with the image processor's settings; tokenizer files are not "
            f"written")
    return HFExport(config, tmap, files=files, notes=[note],
                    loaded_modules=lambda name: loaded_module(name, settings.moe_ffn_hidden_size))


# transformers keeps a MoE layer's routed experts as two 3-D parameters of `mlp.experts` (its conversion mapping
# fuses each expert's gate_proj and up_proj into gate_up_proj [E, 2 ffn, h], gate rows first), in this order
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def loaded_module(name: str, expert_ffn: int) -> tuple[LoadedModule, ...] | str:
    """The module of the Qwen3.5 VLM transformers loads that holds the exported weight `name` (a PEFT adapter's
    target): a linear of the same name but for routed experts, which are rows of their layer's 3-D parameters."""
    expert = _EXPERT.fullmatch(name)
    if expert is not None:
        path, index, linear = expert[1], int(expert[2]), expert[3]
        parameter = "down_proj" if linear == "down_proj" else "gate_up_proj"
        offset = {"gate_proj": 0, "up_proj": expert_ffn}.get(linear)
        return (LoadedModule(path, parameter=parameter, expert=index, parameters=EXPERT_PARAMETERS, offset=offset),)
    if not name.endswith(".weight") or name.endswith(("norm.weight", "patch_embed.proj.weight", "embed_tokens.weight",
                                                      "pos_embed.weight")):
        return "no linear module of the Qwen3.5 VLM transformers loads"
    return (LoadedModule(name.removesuffix(".weight")),)
