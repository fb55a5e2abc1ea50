"""C-RADIO checkpoints of Hugging Face (transformers' `RadioModel`) <-> megatron-core `RADIOViTModel` state dicts.

The Hugging Face side is the checkpoint's own names: what `RadioModel.save_pretrained` writes and the Hub holds
(RADIO's original names; transformers renames them when it loads). The megatron side is `RADIOViTModel.state_dict()`
at TP 1 without any MimoModel prefix (the provider's `RadioEncoder` has the same names). One query group per head.

    radio_model.model.patch_generator.                 (RADIOViTModel)
        embedder.weight                                    embedder.weight        [h, 3*P*P], patches (c, y, x)
        video_embedder.weight (omni checkpoints)           video_embedder.weight  [h, T*3*P*P], (frame, c, y, x)
        pos_embed                                          position_embeddings    [1, G*G, h], G = max_img_size / P
        cls_token.token                                    class_token            [class + register tokens, h]
    radio_model.model.blocks.{i}.                      decoder.layers.{i}.
        norm1.{weight,bias}                                self_attention.linear_qkv.layer_norm_{weight,bias}
        attn.qkv.{weight,bias}                             self_attention.linear_qkv.{weight,bias}  (regrouped)
        attn.proj.{weight,bias}                            self_attention.linear_proj.{weight,bias}
        norm2.{weight,bias}                                mlp.linear_fc1.layer_norm_{weight,bias}
        mlp.fc1.{weight,bias}, mlp.fc2.{weight,bias}       mlp.linear_fc1.{weight,bias}, mlp.linear_fc2.{weight,bias}

RADIO's fused qkv rows are [all query heads; all key heads; all value heads]; megatron's are per head group
[q_0; k_0; v_0; q_1; ...]. Every other tensor keeps its values and layout, so a round trip is bit-identical.

The checkpoint also holds tensors that are no encoder weights; the import checks them against config.json and the
export rebuilds them from it: the input conditioner's mean and std (mimo normalizes pixels in the data path, with
the settings `image_mean` / `image_std` that `config_fields` gives), `summary_idxs`, and LayerScale's `lambda1`
(all ones in C-RADIO; megatron-core's ViT layer has none).
"""

from __future__ import annotations

from typing import Iterator

import torch

from mimo.errors import UsageError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# transformers' RadioConfig defaults, for config.json files that leave a field out.
RADIO_DEFAULTS = dict(
    hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, mlp_ratio=4.0, hidden_act="gelu",
    layer_norm_eps=1e-6, use_swiglu_ffn=False, qkv_bias=True, layerscale_value=1.0, num_channels=3, patch_size=16,
    max_img_size=2048, num_cls_tokens=3, num_registers=7, video_temporal_patch_size=None, summary_idxs=[0, 1],
    norm_mean=CLIP_MEAN, norm_std=CLIP_STD,
)

# Hugging Face activation names -> the provider's `vision_activation`.
ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}

MODEL = "radio_model.model."
CONDITIONER = "radio_model.input_conditioner."
SUMMARY_IDXS = "radio_model.summary_idxs"
CLASS_TOKEN = (MODEL + "patch_generator.cls_token.token", "class_token")  # (checkpoint, megatron)


def _field(hf_config: dict, name: str):
    value = hf_config.get(name)
    return RADIO_DEFAULTS[name] if value is None else value


def _refuse(name: str, value, why: str):
    raise UsageError(f"RADIO config {name}={value!r}: {why}")


def config_fields(hf_config: dict) -> dict:
    """The provider's settings (NemotronVLMSettings fields) for a RADIO config.json; UsageError naming the first
    field whose value the provider's encoder cannot compute."""
    if hf_config.get("model_type", "radio") != "radio":
        _refuse("model_type", hf_config["model_type"], "not a RADIO vision encoder config")
    refusals = {
        "num_channels": (lambda v: v != 3, "megatron-core's RADIO embeds 3-channel patches only"),
        "use_swiglu_ffn": (bool, "the provider's ViT MLP is fc1, GELU, fc2 (no SwiGLU)"),
        "qkv_bias": (lambda v: not v, "the provider's ViT always has query/key/value biases"),
        "layerscale_value": (lambda v: v != 1.0, "megatron-core's ViT layer has no LayerScale"),
        "hidden_act": (lambda v: v not in ACTIVATIONS, f"the provider's ViT has {sorted(ACTIVATIONS)} only"),
        "video_temporal_patch_size": (lambda v: v is not None and v < 2, "a video patch holds 2 frames or more"),
    }
    for name, (refused, why) in refusals.items():
        if refused(_field(hf_config, name)):
            _refuse(name, _field(hf_config, name), why)
    hidden, heads = _field(hf_config, "hidden_size"), _field(hf_config, "num_attention_heads")
    if hf_config.get("head_dim") not in (None, hidden // heads):
        _refuse("head_dim", hf_config["head_dim"], f"the provider's ViT heads are hidden_size / heads = "
                                                   f"{hidden // heads} wide")
    patch, max_size = _field(hf_config, "patch_size"), _field(hf_config, "max_img_size")
    if max_size % patch:
        _refuse("max_img_size", max_size, f"the position grid must be whole patches of {patch}")
    return {
        "vision_layers": _field(hf_config, "num_hidden_layers"),
        "vision_hidden_size": hidden,
        "vision_heads": heads,
        "vision_ffn_hidden_size": int(hidden * _field(hf_config, "mlp_ratio")),  # RADIO truncates the same way
        "patch_size": patch,
        "max_image_size": max_size,
        # Class and register tokens are both prepended and both dropped before the LLM: one count for mimo.
        "class_tokens": _field(hf_config, "num_cls_tokens") + _field(hf_config, "num_registers"),
        "vision_layernorm_epsilon": float(_field(hf_config, "layer_norm_eps")),
        "vision_activation": ACTIVATIONS[_field(hf_config, "hidden_act")],
        "image_mean": tuple(float(v) for v in _field(hf_config, "norm_mean")),
        "image_std": tuple(float(v) for v in _field(hf_config, "norm_std")),
        "video_temporal_patch_size": _field(hf_config, "video_temporal_patch_size") or 1,  # 1: no video embedder
    }


# ------------------------------------------------------------------------------------------------------- names


def _has_video(hf_config: dict) -> bool:
    return _field(hf_config, "video_temporal_patch_size") is not None


def _renamed(num_layers: int, video: bool) -> Iterator[tuple[str, str]]:
    """(checkpoint name, megatron name) of every tensor that only changes its name."""
    yield MODEL + "patch_generator.embedder.weight", "embedder.weight"
    if video:
        yield MODEL + "patch_generator.video_embedder.weight", "video_embedder.weight"
    yield MODEL + "patch_generator.pos_embed", "position_embeddings"
    for i in range(num_layers):
        hf, mg = f"{MODEL}blocks.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            yield hf + f"norm1.{kind}", mg + f"self_attention.linear_qkv.layer_norm_{kind}"
            yield hf + f"attn.proj.{kind}", mg + f"self_attention.linear_proj.{kind}"
            yield hf + f"norm2.{kind}", mg + f"mlp.linear_fc1.layer_norm_{kind}"
            yield hf + f"mlp.fc1.{kind}", mg + f"mlp.linear_fc1.{kind}"
            yield hf + f"mlp.fc2.{kind}", mg + f"mlp.linear_fc2.{kind}"


def _qkv(num_layers: int) -> Iterator[tuple[str, str]]:
    for i in range(num_layers):
        for kind in ("weight", "bias"):
            yield f"{MODEL}blocks.{i}.attn.qkv.{kind}", f"decoder.layers.{i}.self_attention.linear_qkv.{kind}"


def _qkv_to_megatron(fused: torch.Tensor, heads: int) -> torch.Tensor:
    """[q heads; k heads; v heads] -> [q_0; k_0; v_0; q_1; k_1; v_1; ...] (rows of head_dim each)."""
    return fused.reshape(3, heads, -1, *fused.shape[1:]).transpose(0, 1).reshape(fused.shape)


def _qkv_from_megatron(fused: torch.Tensor, heads: int) -> torch.Tensor:
    return fused.reshape(heads, 3, -1, *fused.shape[1:]).transpose(0, 1).reshape(fused.shape)


def _take(state: dict, name: str, where: str) -> torch.Tensor:
    if name not in state:
        raise UsageError(f"{where} has no tensor {name!r}")
    return state.pop(name)


def _non_weights(hf_config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors that are no encoder weights, as config.json determines them (in `dtype`, as
    `RadioModel.to(dtype)` leaves them; the indices stay int64)."""
    tensors = {CONDITIONER + f"norm_{stat}": torch.tensor(_field(hf_config, f"norm_{stat}"), dtype=torch.float32)
               .view(-1, 1, 1).to(dtype) for stat in ("mean", "std")}
    tensors[SUMMARY_IDXS] = torch.tensor(_field(hf_config, "summary_idxs"), dtype=torch.long)
    hidden = _field(hf_config, "hidden_size")
    for i in range(_field(hf_config, "num_hidden_layers")):
        for k in (1, 2):
            tensors[f"{MODEL}blocks.{i}.layer_scale{k}.lambda1"] = torch.ones(hidden, dtype=dtype)
    return tensors


def _check_non_weights(state: dict, hf_config: dict) -> None:
    """Take the checkpoint's non-weight tensors out of `state`, refusing any that config.json does not explain
    (a checkpoint may leave them out: `RadioModel` then builds them from the config)."""
    for name, expected in _non_weights(hf_config, torch.float32).items():
        if name not in state:
            continue
        found = state.pop(name)
        if not torch.equal(found, expected.to(found.dtype)):
            what = "not all ones (megatron-core's ViT layer has no LayerScale)" if "lambda1" in name else \
                f"{found.flatten().tolist()}, config.json gives {expected.flatten().tolist()}"
            raise UsageError(f"RADIO checkpoint tensor {name} is {what}")


# ------------------------------------------------------------------------------------------------ conversions


def to_megatron(hf_state: dict[str, torch.Tensor], hf_config: dict) -> dict[str, torch.Tensor]:
    """A RADIO checkpoint's tensors -> RADIOViTModel's state dict (without `_extra_state` entries)."""
    config_fields(hf_config)  # refuses what the provider's encoder cannot compute
    state, where = dict(hf_state), "the RADIO checkpoint"
    layers, heads = _field(hf_config, "num_hidden_layers"), _field(hf_config, "num_attention_heads")
    out = {mg: _take(state, hf, where) for hf, mg in _renamed(layers, _has_video(hf_config))}
    out.update({mg: _qkv_to_megatron(_take(state, hf, where), heads) for hf, mg in _qkv(layers)})
    class_token = _take(state, CLASS_TOKEN[0], where)
    if class_token.shape[0]:  # RADIOViTModel holds no class_token parameter without class tokens
        out[CLASS_TOKEN[1]] = class_token
    _check_non_weights(state, hf_config)
    if state:
        raise UsageError(f"the RADIO checkpoint has tensors the encoder has no place for: {sorted(state)}")
    return out


def from_megatron(state: dict[str, torch.Tensor], hf_config: dict) -> dict[str, torch.Tensor]:
    """RADIOViTModel's state dict -> the tensors of a RADIO checkpoint (`RadioModel.from_pretrained` loads them
    with nothing missing or unexpected). `_extra_state` entries are ignored."""
    config_fields(hf_config)
    state = {name: t for name, t in state.items() if not name.endswith("_extra_state")}
    where = "the RADIOViTModel state dict"
    layers, heads = _field(hf_config, "num_hidden_layers"), _field(hf_config, "num_attention_heads")
    out = {hf: _take(state, mg, where) for hf, mg in _renamed(layers, _has_video(hf_config))}
    out.update({hf: _qkv_from_megatron(_take(state, mg, where), heads) for hf, mg in _qkv(layers)})
    weights = out[MODEL + "patch_generator.embedder.weight"]
    out[CLASS_TOKEN[0]] = state.pop(CLASS_TOKEN[1]) if CLASS_TOKEN[1] in state else weights.new_empty(
        0, weights.shape[0])
    out.update(_non_weights(hf_config, weights.dtype))
    if state:
        raise UsageError(f"{where} has tensors a RADIO checkpoint has no place for: {sorted(state)}")
    return out
