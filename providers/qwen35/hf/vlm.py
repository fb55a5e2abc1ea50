"""Hugging Face checkpoints of the Qwen3.5 family for the provider's hooks: a whole
`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` folder (`--pretrained HF_DIR`, `mimo ckpt
import-hf HF_DIR`), or the language model alone (`qwen3_5_text`, `qwen3_5_moe_text`: `--pretrained-llm DIR`, and
`--pretrained DIR` while the provider builds no vision tower; what `mimo ckpt export-hf` writes).

    model.language_model.*, lm_head.weight    the language model    language_model.*    (hf/qwen3_5.py)
    model.visual.*                            the vision tower      (not read yet: the vision tower's own map)
"""

from __future__ import annotations

from mimo import LANGUAGE, module_prefix
from mimo.errors import UsageError
from mimo.plugins.kit.tensor_map import HFExport, TensorMap

from . import qwen3_5
from ..settings import Qwen35Settings

VLM_TYPES = ("qwen3_5", "qwen3_5_moe")
LANGUAGE_PREFIX = module_prefix(LANGUAGE)
VISION_PREFIX = "model.visual."


def _text_config(hf_config: dict) -> dict:
    text = dict(hf_config.get("text_config") or {})
    if not text:
        raise UsageError(f"Hugging Face config model_type={hf_config.get('model_type')!r} has no text_config")
    # the VLM's own tie_word_embeddings (top level) ties its lm_head, whatever text_config says
    text["tie_word_embeddings"] = hf_config.get("tie_word_embeddings", False)
    return text


def hf_settings(hf_config: dict, part: str) -> dict | None:
    model_type = hf_config.get("model_type")
    if part == "language":
        return qwen3_5.config_fields(hf_config) if model_type in qwen3_5.TEXT_TYPES else None
    if part == "model" and model_type in qwen3_5.TEXT_TYPES:
        # the language model alone is the whole model while the provider builds no vision tower (and what
        # hf_export writes): a Qwen3_5ForCausalLM folder reads as `--pretrained` too
        return qwen3_5.config_fields(hf_config)
    if part != "model" or model_type not in VLM_TYPES:
        return None
    fields = qwen3_5.config_fields(_text_config(hf_config))
    if hf_config.get("image_token_id") is not None:
        fields["image_token_id"] = hf_config["image_token_id"]
    return fields


def hf_tensor_map(settings: Qwen35Settings, hf_config: dict, part: str) -> TensorMap | None:
    model_type = hf_config.get("model_type")
    if part in ("language", "model") and model_type in qwen3_5.TEXT_TYPES:
        return qwen3_5.tensor_map(vars(settings), "model.").prefixed(LANGUAGE_PREFIX, "")
    if part == "model" and model_type in VLM_TYPES:
        tmap = qwen3_5.tensor_map(vars(settings), "model.language_model.").prefixed(LANGUAGE_PREFIX, "")
        tmap.ignored += (VISION_PREFIX,)  # the vision tower has no map yet: its weights are not read
        return tmap
    return None


# ------------------------------------------------------------------------------------------------------ export


def hf_export_check(settings: Qwen35Settings) -> dict:
    """Every setting is a Qwen3.5 text config's: nothing refused."""
    return {}


def hf_export(settings: Qwen35Settings) -> HFExport:
    """The language model as a `Qwen3_5ForCausalLM` (or `Qwen3_5MoeForCausalLM`) folder, which transformers loads
    and `--pretrained-llm` reads back; the whole VLM folder comes with the vision tower's map."""
    tmap = qwen3_5.tensor_map(vars(settings), "model.").prefixed(LANGUAGE_PREFIX, "")
    config = qwen3_5.text_config(settings)
    note = (f"the language model alone, as a {config['architectures'][0]} folder (the vision tower is not exported "
            f"yet); tokenizer files are not written")
    return HFExport(config, tmap, notes=[note])
