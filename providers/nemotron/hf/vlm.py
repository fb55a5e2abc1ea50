"""Hugging Face checkpoints of the Nemotron omni VLM (transformers' `nemotron_h_omni`) <-> this provider's model.

The omni checkpoint's image path and LLM map onto the MimoModel (names as `MimoModel.state_dict()` gives them):

    vision_model.*      RADIO         modality_submodules.images.encoders.radio.*        (hf/radio.py)    
    mlp1.*              projector     modality_submodules.images.input_projections.0.*   (hf/nemotron_h_omni.py)    
    language_model.*    NemotronH     language_model.*                                   (hf/nemotron_h.py)    

The audio branch (`audio_tower.*`, `embed_audio.*`) has no place in this provider: import leaves it out, export
writes a config without one. Checkpoints of the LLM alone (`nemotron_h`) or the encoder alone
(`radio`) are refused: the other module's weights would have to come from elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping

from mimo import LANGUAGE, module_prefix
from mimo.errors import UsageError
from . import nemotron_h, nemotron_h_omni, radio

from ..settings import ENCODER, IMAGES, NemotronVLMSettings
from ..specs import resolve_backend

OMNI = "nemotron_h_omni"
PARTIAL = {"nemotron_h": "the language model", "radio": "the vision encoder"}
LANGUAGE_PREFIX = module_prefix(LANGUAGE)
ENCODER_PREFIX = f"{module_prefix(IMAGES)}encoders.{ENCODER}."
PROJECTION_PREFIX = f"{module_prefix(IMAGES)}input_projections.0."
HF_LANGUAGE = "language_model."
AUDIO_PREFIXES = ("audio_tower.", "embed_audio.")
# NemotronH layers_block_type names of the provider's layer symbols (as NemotronHConfig writes them).
LAYER_TYPES = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}
ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


# ------------------------------------------------------------------------------------------------------ import


def hf_settings(hf_config: dict) -> dict | None:
    """The settings of an omni config.json: image path, projector and LLM; None for other model types."""
    model_type = hf_config.get("model_type")
    if model_type in PARTIAL:
        raise UsageError(f"Hugging Face config model_type={model_type!r}: the checkpoint holds only "
                         f"{PARTIAL[model_type]}; mimo imports whole VLM checkpoints ({OMNI})")
    if model_type != OMNI:
        return None
    fields = nemotron_h_omni.config_fields(hf_config)
    fields.update(nemotron_h.config_fields(nemotron_h_omni.text_config(hf_config)))
    image_token = hf_config.get("image_token_id", hf_config.get("img_context_token_id"))  # released: img_context_...
    if image_token is not None:
        fields["image_token_id"] = image_token
    return fields


def hf_to_mimo(settings: NemotronVLMSettings, hf_config: dict, hf_tensors) -> dict | None:
    """An omni checkpoint's tensors -> MimoModel state-dict tensors (the LLM's read lazily); audio left out."""
    if hf_config.get("model_type") != OMNI:
        return None
    experts = "grouped" if resolve_backend(settings.backend) == "te" else "sequential"
    language = _Prefixed(hf_tensors, HF_LANGUAGE)
    image_path = nemotron_h_omni.to_megatron(
        {name: hf_tensors[name] for name in hf_tensors if name.startswith(("vision_model.", "mlp1."))}, hf_config)
    known = ("vision_model.", "mlp1.", HF_LANGUAGE, *AUDIO_PREFIXES)
    if unknown := sorted(name for name in hf_tensors if not name.startswith(known)):
        raise UsageError(f"the omni checkpoint has tensors the provider has no place for: {unknown[:3]}")
    state = {LANGUAGE_PREFIX + name: t for name, t in
             nemotron_h.to_megatron(language, nemotron_h_omni.text_config(hf_config), experts).items()}
    state.update({ENCODER_PREFIX + name: t for name, t in image_path["encoder"].items()})
    state.update({PROJECTION_PREFIX + name: t for name, t in image_path["projection"].items()})
    return state


class _Prefixed(Mapping):
    """The tensors of `tensors` under `prefix`, named without it; each read only when asked for."""

    def __init__(self, tensors: Mapping, prefix: str):
        self._tensors, self._prefix = tensors, prefix
        self._names = [name[len(prefix):] for name in tensors if name.startswith(prefix)]

    def __getitem__(self, name: str):
        return self._tensors[self._prefix + name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


# ------------------------------------------------------------------------------------------------------ export


def mimo_to_hf(settings: NemotronVLMSettings, state: dict) -> tuple[dict, dict]:
    hf_config = omni_config(settings)
    language = {n[len(LANGUAGE_PREFIX):]: t for n, t in state.items() if n.startswith(LANGUAGE_PREFIX)}
    encoder = {n[len(ENCODER_PREFIX):]: t for n, t in state.items() if n.startswith(ENCODER_PREFIX)}
    projection = {n[len(PROJECTION_PREFIX):]: t for n, t in state.items() if n.startswith(PROJECTION_PREFIX)}
    tensors = nemotron_h_omni.from_megatron({"encoder": encoder, "projection": projection}, hf_config)
    tensors.update({HF_LANGUAGE + n: t for n, t in
                    nemotron_h.from_megatron(language, hf_config["text_config"]).items()})
    return hf_config, tensors


def omni_config(s: NemotronVLMSettings) -> dict:
    """The omni config.json of settings; UsageError naming the first setting the omni model cannot express."""
    needs = {"pixel_shuffle": True, "projection": "mlp", "projection_norm": True, "dynamic_resolution": True}
    for name, value in needs.items():
        if getattr(s, name) != value:
            raise UsageError(f"setting {name}={getattr(s, name)!r}: the Nemotron omni model has {name}={value!r}")
    if s.video_temporal_patch_size < 2:
        raise UsageError(f"setting video_temporal_patch_size={s.video_temporal_patch_size}: the Nemotron omni "
                         f"model's RADIO has a video patch embedder (2 frames or more)")
    mlp_ratio = s.vision_ffn_hidden_size / s.vision_hidden_size
    if int(s.vision_hidden_size * mlp_ratio) != s.vision_ffn_hidden_size:
        raise UsageError(f"setting vision_ffn_hidden_size={s.vision_ffn_hidden_size}: RADIO's MLP is "
                         f"int(hidden_size x mlp_ratio) wide, which no ratio makes of {s.vision_hidden_size}")
    vision = dict(
        model_type="radio", hidden_size=s.vision_hidden_size, num_hidden_layers=s.vision_layers,
        num_attention_heads=s.vision_heads, mlp_ratio=mlp_ratio,
        hidden_act=ACTIVATIONS[s.vision_activation], layer_norm_eps=s.vision_layernorm_epsilon,
        patch_size=s.patch_size, max_img_size=s.max_image_size,
        # mimo keeps one count of class and register tokens (all dropped before the LLM): all class tokens here.
        num_cls_tokens=s.class_tokens, num_registers=0, summary_idxs=list(range(min(2, s.class_tokens))),
        norm_mean=list(s.image_mean), norm_std=list(s.image_std), video_temporal_patch_size=s.video_temporal_patch_size,
        qkv_bias=True, use_swiglu_ffn=False, layerscale_value=1.0, num_channels=3)
    text = dict(
        model_type="nemotron_h", layers_block_type=[LAYER_TYPES[c] for c in s.hybrid_pattern],
        hidden_size=s.hidden_size, vocab_size=s.vocab_size, hidden_dropout=s.dropout, attention_dropout=s.dropout,
        initializer_range=s.init_method_std, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_query_groups, head_dim=s.kv_channels, mamba_num_heads=s.mamba_num_heads,
        mamba_head_dim=s.mamba_head_dim, n_groups=s.mamba_num_groups, ssm_state_size=s.mamba_state_dim,
        conv_kernel=s.mamba_conv_kernel, n_routed_experts=s.num_experts, num_experts_per_tok=s.moe_router_topk,
        moe_intermediate_size=s.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=s.moe_shared_expert_intermediate_size,
        routed_scaling_factor=s.moe_router_topk_scaling_factor, intermediate_size=s.ffn_hidden_size,
        tie_word_embeddings=False, num_nextn_predict_layers=0,
        time_step_min=s.mamba_dt_clamp_min)  # the reference clamps dt at time_step_min, mimo at mamba_dt_clamp_min
    from ..tokens import image_token_id

    return dict(model_type=OMNI, architectures=["NemotronH_Omni_Reasoning_V3"], vision_config=vision,
                text_config=text, audio_config=None, downsample_ratio=0.5,
                projector_hidden_size=s.projection_hidden_size, vision_hidden_size=s.vision_hidden_size,
                video_temporal_patch_size=s.video_temporal_patch_size, image_token_id=image_token_id(s))
