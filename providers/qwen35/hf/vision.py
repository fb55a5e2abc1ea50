"""Qwen3.5-VL's vision tower in Hugging Face checkpoints (transformers' `Qwen3_5VisionModel`, `model.visual.` of
`Qwen3_5ForConditionalGeneration`) <-> the provider's tower and patch merger (providers/qwen35/vision.py).

The Hugging Face names are relative to the vision model (the provider prefixes them with `model.visual.`); the
megatron keys are the dist-checkpoint keys of the tower (the modality's encoder) and of the merger (its input
projection). The TransformerBlock saves each parameter kind once, stacked over the blocks.

    tower (Qwen35VisionTower)                          Hugging Face
        patch_embed.{weight,bias}                          patch_embed.proj.{weight,bias}  [h, C, T, P, P]: as is
        pos_embed.weight                                   pos_embed.weight                [side^2, h]
        decoder.layers.                                    blocks.{i}.
            input_layernorm.{weight,bias}                      norm1.{weight,bias}
            self_attention.linear_qkv.{weight,bias}            attn.qkv.{weight,bias}          (regrouped)
            self_attention.linear_proj.{weight,bias}           attn.proj.{weight,bias}
            pre_mlp_layernorm.{weight,bias}                    norm2.{weight,bias}
            mlp.linear_fc1.{weight,bias}                       mlp.linear_fc1.{weight,bias}
            mlp.linear_fc2.{weight,bias}                       mlp.linear_fc2.{weight,bias}
    merger (Qwen35PatchMerger)
        norm.{weight,bias}                                 merger.norm.{weight,bias}
        encoder.linear_fc1.{weight,bias}                   merger.linear_fc1.{weight,bias}
        encoder.linear_fc2.{weight,bias}                   merger.linear_fc2.{weight,bias}

The fused qkv rows are [all query heads; all key heads; all value heads] in transformers and per head [q_h; k_h;
v_h] in megatron-core (one query group per head, so tensor parallelism splits whole heads); every other tensor
keeps its values and layout, so a round trip is bit-identical.
"""

from __future__ import annotations

from mimo.errors import UsageError
from mimo.plugins.kit.tensor_map import Cat, Src, Stack, TensorMap

# transformers' Qwen3_5VisionConfig defaults, for config.json files that leave a field out.
VISION_DEFAULTS = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
                       num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                       out_hidden_size=3584, num_position_embeddings=2304)
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}
HF_ACTIVATIONS = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}
ROPE_THETA = 10000.0

LAYER_TENSORS = {  # key under decoder.layers. -> name under blocks.{i}.
    "input_layernorm.weight": "norm1.weight", "input_layernorm.bias": "norm1.bias",
    "self_attention.linear_proj.weight": "attn.proj.weight", "self_attention.linear_proj.bias": "attn.proj.bias",
    "pre_mlp_layernorm.weight": "norm2.weight", "pre_mlp_layernorm.bias": "norm2.bias",
    "mlp.linear_fc1.weight": "mlp.linear_fc1.weight", "mlp.linear_fc1.bias": "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight": "mlp.linear_fc2.weight", "mlp.linear_fc2.bias": "mlp.linear_fc2.bias",
}
MERGER_TENSORS = {"norm.weight": "merger.norm.weight", "norm.bias": "merger.norm.bias",
                  "encoder.linear_fc1.weight": "merger.linear_fc1.weight",
                  "encoder.linear_fc1.bias": "merger.linear_fc1.bias",
                  "encoder.linear_fc2.weight": "merger.linear_fc2.weight",
                  "encoder.linear_fc2.bias": "merger.linear_fc2.bias"}


def _field(hf_config: dict, name: str):
    value = hf_config.get(name)
    return VISION_DEFAULTS[name] if value is None else value


def _refuse(name: str, value, why: str):
    raise UsageError(f"Qwen3.5 vision config {name}={value!r}: {why}")


def _single(hf_config: dict, name: str) -> int:
    """patch_size and temporal_patch_size may be given per axis; the tower has one value."""
    value = _field(hf_config, name)
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            _refuse(name, value, "the provider's tower takes one size for every axis")
        value = value[0]
    return int(value)


def config_fields(hf_config: dict) -> dict:
    """The provider's settings (Qwen35VisionSettings fields) for a `vision_config`; UsageError naming the first
    field the tower cannot compute."""
    if hf_config.get("model_type", "qwen3_5_vision") not in ("qwen3_5_vision", "qwen3_5_moe_vision"):
        _refuse("model_type", hf_config["model_type"], "not a Qwen3.5 vision config")
    if _field(hf_config, "in_channels") != 3:
        _refuse("in_channels", hf_config["in_channels"], "the tower embeds 3-channel (RGB) patches only")
    act = _field(hf_config, "hidden_act")
    if act not in ACTIVATIONS:
        _refuse("hidden_act", act, f"the tower's MLP has {sorted(ACTIVATIONS)} only")
    rope = hf_config.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        _refuse("rope_parameters", rope, "the tower's rotary embedding is the axial (2-D) one")
    hidden, heads = _field(hf_config, "hidden_size"), _field(hf_config, "num_heads")
    if hidden % heads or (hidden // heads) % 4:
        _refuse("num_heads", heads, f"hidden_size {hidden} must split into heads of a multiple of 4 channels")
    return {
        "vision_depth": _field(hf_config, "depth"), "vision_hidden_size": hidden, "vision_heads": heads,
        "vision_intermediate_size": _field(hf_config, "intermediate_size"),
        "vision_activation": ACTIVATIONS[act],
        "vision_position_embeddings": _field(hf_config, "num_position_embeddings"),
        "vision_rope_theta": float(rope.get("rope_theta", ROPE_THETA)),
        "vision_out_hidden_size": _field(hf_config, "out_hidden_size"),
        "patch_size": _single(hf_config, "patch_size"),
        "temporal_patch_size": _single(hf_config, "temporal_patch_size"),
        "spatial_merge_size": _field(hf_config, "spatial_merge_size"),
    }


def vision_config(s) -> dict:
    """The `vision_config` of settings `s` (an export's config.json)."""
    return dict(model_type="qwen3_5_vision", depth=s.vision_depth, hidden_size=s.vision_hidden_size,
                hidden_act=HF_ACTIVATIONS[s.vision_activation], intermediate_size=s.vision_intermediate_size,
                num_heads=s.vision_heads, in_channels=3, patch_size=s.patch_size,
                spatial_merge_size=s.spatial_merge_size, temporal_patch_size=s.temporal_patch_size,
                out_hidden_size=s.vision_output_size, num_position_embeddings=s.vision_position_embeddings,
                rope_parameters={"rope_type": "axial", "rope_theta": s.vision_rope_theta})


def processor_config(s) -> dict:
    """The image processor's preprocessor_config.json fields for settings `s` (transformers' Qwen2VL processor)."""
    return dict(image_processor_type="Qwen2VLImageProcessor", do_resize=True, resample=3, do_rescale=True,
                rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True, image_mean=list(s.image_mean),
                image_std=list(s.image_std), size={"shortest_edge": s.min_pixels, "longest_edge": s.max_pixels},
                patch_size=s.patch_size, temporal_patch_size=s.temporal_patch_size,
                merge_size=s.spatial_merge_size)


def tower_map(s) -> TensorMap:
    """Where each dist-checkpoint key of the tower is among the vision model's tensors."""
    layers, heads = s.vision_depth, s.vision_heads
    d = s.vision_hidden_size // heads
    t = {"patch_embed.weight": Src("patch_embed.proj.weight"), "patch_embed.bias": Src("patch_embed.proj.bias"),
         "pos_embed.weight": Src("pos_embed.weight")}
    for key, name in LAYER_TENSORS.items():
        t["decoder.layers." + key] = Stack(tuple(Src(f"blocks.{i}.{name}") for i in range(layers)))
    for kind in ("weight", "bias"):  # [q heads; k heads; v heads] -> per head [q_h; k_h; v_h]: whole heads per rank
        t[f"decoder.layers.self_attention.linear_qkv.{kind}"] = Stack(tuple(
            Cat(tuple(Src(f"blocks.{i}.attn.qkv.{kind}", (w * heads * d + h * d, w * heads * d + (h + 1) * d))
                      for h in range(heads) for w in range(3))) for i in range(layers)))
    return TensorMap(t, covers=("",))


def merger_map(s) -> TensorMap:
    """Where each dist-checkpoint key of the patch merger is among the vision model's tensors."""
    return TensorMap({key: Src(name) for key, name in MERGER_TENSORS.items()}, covers=("",))
