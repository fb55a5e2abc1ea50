"""C-RADIO checkpoints of Hugging Face (transformers' `RadioModel`) <-> megatron-core `RADIOViTModel`.

The Hugging Face side is the checkpoint's own names: what `RadioModel.save_pretrained` writes and the Hub holds
(RADIO's original names; transformers renames them when it loads). The megatron side is the encoder's
dist-checkpoint keys (relative to it): its TransformerBlock saves each parameter kind once, stacked over layers
(`decoder.layers.self_attention.linear_qkv.weight` [L, 3h, h]). One query group per head.

    radio_model.model.patch_generator.                 (RADIOViTModel)
        embedder.weight                                    embedder.weight        [h, 3*P*P], patches (c, y, x)
        video_embedder.weight (omni checkpoints)           video_embedder.weight  [h, T*3*P*P], (frame, c, y, x)
        pos_embed                                          position_embeddings    [1, G*G, h], G = max_img_size / P
        cls_token.token                                    class_token            [class + register tokens, h]
    radio_model.model.blocks.{i}.                      decoder.layers.
        norm1.{weight,bias}                                self_attention.linear_qkv.layer_norm_{weight,bias}
        attn.qkv.{weight,bias}                             self_attention.linear_qkv.{weight,bias}  (regrouped)
        attn.proj.{weight,bias}                            self_attention.linear_proj.{weight,bias}
        norm2.{weight,bias}                                mlp.linear_fc1.layer_norm_{weight,bias}
        mlp.fc1.{weight,bias}, mlp.fc2.{weight,bias}       mlp.linear_fc1.{weight,bias}, mlp.linear_fc2.{weight,bias}
    (decoder.layers.<param> stacks blocks 0..L-1)

RADIO's fused qkv rows are [all query heads; all key heads; all value heads]; megatron's are per head group
[q_0; k_0; v_0; q_1; ...]. Every other tensor keeps its values and layout, so a round trip is bit-identical.

The checkpoint also holds tensors that are no encoder weights; the import checks them against config.json and the
export rebuilds them from it: the input conditioner's mean and std (mimo normalizes pixels in the data path, with
the settings `image_mean` / `image_std` that `config_fields` gives), `summary_idxs`, and LayerScale's `lambda1`
(all ones in C-RADIO; megatron-core's ViT layer has none).
"""

from __future__ import annotations

import re

import torch

from mimo.errors import UsageError
from mimo.plugins.kit.tensor_map import Cat, LoadedModule, Src, Stack, TensorMap

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


# -------------------------------------------------------------------------------------------------- tensor map

LAYER_TENSORS = {  # key under decoder.layers. -> name under radio_model.model.blocks.{i}.
    "self_attention.linear_qkv.layer_norm_weight": "norm1.weight",
    "self_attention.linear_qkv.layer_norm_bias": "norm1.bias",
    "self_attention.linear_proj.weight": "attn.proj.weight", "self_attention.linear_proj.bias": "attn.proj.bias",
    "mlp.linear_fc1.layer_norm_weight": "norm2.weight", "mlp.linear_fc1.layer_norm_bias": "norm2.bias",
    "mlp.linear_fc1.weight": "mlp.fc1.weight", "mlp.linear_fc1.bias": "mlp.fc1.bias",
    "mlp.linear_fc2.weight": "mlp.fc2.weight", "mlp.linear_fc2.bias": "mlp.fc2.bias",
}


def tensor_map(s, hf_config: dict | None = None, conditioner: bool = True) -> TensorMap:
    """Where each dist-checkpoint key of the encoder is in a RADIO checkpoint, for settings `s`. `hf_config`:
    the checkpoint's config.json, against which its non-weight tensors are checked (import); `conditioner`: the
    checkpoint holds the input conditioner (a RADIO folder does, the omni model's RADIO does not)."""
    layers, heads = s.vision_layers, s.vision_heads
    d = s.vision_hidden_size // heads
    t = {"embedder.weight": Src(MODEL + "patch_generator.embedder.weight"),
         "position_embeddings": Src(MODEL + "patch_generator.pos_embed")}
    if s.video_temporal_patch_size > 1:
        t["video_embedder.weight"] = Src(MODEL + "patch_generator.video_embedder.weight")
    if s.class_tokens:  # RADIOViTModel holds no class_token parameter without class tokens
        t[CLASS_TOKEN[1]] = Src(CLASS_TOKEN[0])
    for key, name in LAYER_TENSORS.items():
        t["decoder.layers." + key] = Stack(tuple(Src(f"{MODEL}blocks.{i}.{name}") for i in range(layers)))
    for kind in ("weight", "bias"):  # [q heads; k heads; v heads] -> per head [q_h; k_h; v_h]: whole heads per rank
        t[f"decoder.layers.self_attention.linear_qkv.{kind}"] = Stack(tuple(
            Cat(tuple(Src(f"{MODEL}blocks.{i}.attn.qkv.{kind}", (w * heads * d + h * d, w * heads * d + (h + 1) * d))
                      for h in range(heads) for w in range(3))) for i in range(layers)))
    checks, derived = {}, {}
    for name, make in _non_weights(s, conditioner).items():
        checks[name] = _check(name, make, hf_config)
        derived[name] = (("embedder.weight",), make)  # export: in the weights' dtype, as RadioModel.to(dtype)
    if not s.class_tokens:
        checks[CLASS_TOKEN[0]] = lambda x: None if x.numel() == 0 else f"holds {x.shape[0]} class tokens, the " \
                                                                         f"settings none"
        derived[CLASS_TOKEN[0]] = (("embedder.weight",), lambda w: w.new_empty(0, w.shape[0]))
    return TensorMap(t, covers=("",), checks=checks, derived=derived)


def _non_weights(s, conditioner: bool) -> dict:
    """The checkpoint's tensors that are no encoder weights, as the settings determine them: name -> fn(embedder
    weight) -> tensor (in its dtype; the indices stay int64)."""
    makers = {SUMMARY_IDXS: lambda w: torch.tensor(list(range(min(2, s.class_tokens))), dtype=torch.long)}
    if conditioner:
        for stat, values in (("mean", s.image_mean), ("std", s.image_std)):
            makers[CONDITIONER + f"norm_{stat}"] = \
                lambda w, values=values: torch.tensor(values, dtype=torch.float32).view(-1, 1, 1).to(w.dtype)
    for i in range(s.vision_layers):
        for k in (1, 2):
            makers[f"{MODEL}blocks.{i}.layer_scale{k}.lambda1"] = lambda w: torch.ones(s.vision_hidden_size,
                                                                                        dtype=w.dtype)
    return makers


def _check(name: str, make, hf_config: dict | None):
    """A check of one non-weight tensor read from a checkpoint: LayerScale must be the identity, the
    conditioner's statistics and summary_idxs what config.json says (import takes image_mean / image_std from
    there)."""
    def check(found: torch.Tensor) -> str | None:
        if "lambda1" in name:
            return None if torch.all(found == 1) else "is not all ones (megatron-core's ViT layer has no LayerScale)"
        if hf_config is None:
            return None
        field = "summary_idxs" if name == SUMMARY_IDXS else name.rpartition(".")[2]  # norm_mean, norm_std
        expected = torch.tensor(_field(hf_config, field))
        if not torch.equal(found.flatten(), expected.flatten().to(found.dtype)):
            return f"is {found.flatten().tolist()}, config.json gives {expected.flatten().tolist()}"
        return None

    return check


# transformers' load-time renaming of RADIO's linears (its conversion mapping for model type radio)
LOADED = {MODEL + "patch_generator.embedder.": "embeddings.patch_projection",
          MODEL + "patch_generator.video_embedder.": "embeddings.video_patch_projection"}
_BLOCK_LINEAR = re.compile(rf"^{re.escape(MODEL)}blocks\.(\d+)\.(attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.weight$")


def loaded_module(name: str, hidden: int) -> tuple[LoadedModule, ...] | str:
    """The modules of transformers' RadioModel that hold the checkpoint weight `name` once loaded: the fused qkv
    splits into q_proj, k_proj and v_proj (three row windows of `hidden`), blocks become encoder.layer."""
    for prefix, module in LOADED.items():
        if name == prefix + "weight":
            return (LoadedModule(module),)
    match = _BLOCK_LINEAR.match(name)
    if match is None:
        return "no linear module of transformers' RadioModel"
    layer, linear = f"encoder.layer.{match[1]}.", match[2]
    if linear == "attn.qkv":
        return tuple(LoadedModule(f"{layer}attention.{p}_proj", (i * hidden, (i + 1) * hidden))
                     for i, p in enumerate("qkv"))
    return (LoadedModule(layer + {"attn.proj": "attention.o_proj"}.get(linear, linear)),)


def vision_config(s) -> dict:
    """The RADIO config.json of settings `s` (the omni model's vision_config). mimo keeps one count of class and
    register tokens (all dropped before the LLM): all class tokens here."""
    mlp_ratio = s.vision_ffn_hidden_size / s.vision_hidden_size
    return dict(
        model_type="radio", hidden_size=s.vision_hidden_size, num_hidden_layers=s.vision_layers,
        num_attention_heads=s.vision_heads, mlp_ratio=mlp_ratio, hidden_act=HF_ACTIVATIONS[s.vision_activation],
        layer_norm_eps=s.vision_layernorm_epsilon, patch_size=s.patch_size, max_img_size=s.max_image_size,
        num_cls_tokens=s.class_tokens, num_registers=0, summary_idxs=list(range(min(2, s.class_tokens))),
        norm_mean=list(s.image_mean), norm_std=list(s.image_std),
        video_temporal_patch_size=s.video_temporal_patch_size if s.video_temporal_patch_size > 1 else None,
        qkv_bias=True, use_swiglu_ffn=False, layerscale_value=1.0, num_channels=3)


HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def inflated_video_embedder(frames: int):
    """A video patch embedder made from the image embedder [h, 3P^2]: `frames` identical frames embed as the image
    patch (patches ordered (frame, c, y, x)). For an omni export of a RADIO that has none."""
    return lambda w: torch.cat([w / frames] * frames, dim=1)
