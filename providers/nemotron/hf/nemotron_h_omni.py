"""The image path of Nemotron omni checkpoints (transformers' `nemotron_h_omni`) <-> the provider's vision modality:
the RADIO encoder (`vision_model.`, mapped by `radio`) and the projector `mlp1` into the LLM.

Between the two, both models pixel-shuffle each image's patch grid the same way: 2 x 2 blocks of patches, the
blocks row-major, each block's channels ordered (row in block, column in block, channel) - transformers'
`pixel_shuffle` with downsample_ratio 0.5 and the provider's `pixel_shuffle` (tests/unit/test_hf_radio.py checks both).
The projector is an RMSNorm, a linear layer, squared ReLU and a linear layer, no biases; on the megatron side it
is the provider's `MultimodalProjector` (projection "mlp" with `projection_norm`):

    mlp1.0.weight   RMSNorm (eps 1e-5) of the shuffled token   encoder.linear_fc1.layer_norm_weight
    mlp1.1.weight   linear_1                                   encoder.linear_fc1.weight
    mlp1.3.weight   linear_2                                   encoder.linear_fc2.weight

The omni model normalizes pixels in its image processor (its RADIO has no input conditioner), as mimo's data path
does. The language model (`language_model.`) and the audio branch are not this module's.
"""

from __future__ import annotations

from mimo.errors import UsageError
from mimo.plugins.kit.tensor_map import LoadedModule, Src, TensorMap

from . import radio

VISION = "vision_model."
PROJECTOR = {"mlp1.0.weight": "encoder.linear_fc1.layer_norm_weight", "mlp1.1.weight": "encoder.linear_fc1.weight",
             "mlp1.3.weight": "encoder.linear_fc2.weight"}


# the projector's linears as transformers names them once loaded (its renaming of mlp1.1 and mlp1.3)
LOADED_PROJECTOR = {"mlp1.1.weight": "multi_modal_projector.linear_1",
                    "mlp1.3.weight": "multi_modal_projector.linear_2"}


def _vision_config(hf_config: dict) -> dict:
    return {"model_type": "radio", **(hf_config.get("vision_config") or {})}


def text_config(hf_config: dict) -> dict:
    return hf_config.get("text_config") or hf_config.get("llm_config") or {}  # released configs: llm_config


def config_fields(hf_config: dict, processor_config: dict | None = None) -> dict:
    """The provider's settings for the image path of an omni config.json: RADIO's (see `radio.config_fields`),
    the pixel shuffle and the projector. The pixel statistics come from the image processor's config
    (preprocessor_config.json) when given, else from the vision config. UsageError naming a value the provider
    cannot compute."""
    if hf_config.get("model_type", "nemotron_h_omni") != "nemotron_h_omni":
        raise UsageError(f"omni config model_type={hf_config['model_type']!r}: not a Nemotron omni config")
    ratio = hf_config.get("downsample_ratio", 0.5)
    if ratio != 0.5:
        raise UsageError(f"omni config downsample_ratio={ratio!r}: the provider pixel-shuffles 2 x 2 blocks only")
    mtp = text_config(hf_config).get("num_nextn_predict_layers") or 0
    if mtp:  # transformers then adds a LayerNorm between RADIO and the projector (vision_final_layernorm)
        raise UsageError(f"omni config text_config.num_nextn_predict_layers={mtp!r}: the provider has no "
                         f"LayerNorm between RADIO and the projector (vision_final_layernorm)")
    fields = radio.config_fields(_vision_config(hf_config))
    width = hf_config.get("vision_hidden_size", hf_config.get("vit_hidden_size", fields["vision_hidden_size"]))
    if width != fields["vision_hidden_size"]:
        raise UsageError(f"omni config vision_hidden_size={width!r}: its vision_config has hidden_size "
                         f"{fields['vision_hidden_size']}")
    if processor_config:  # released processors name them norm_mean / norm_std
        for field, names in (("image_mean", ("image_mean", "norm_mean")), ("image_std", ("image_std", "norm_std"))):
            value = next((processor_config[n] for n in names if processor_config.get(n) is not None), None)
            if value is not None:
                fields[field] = tuple(float(v) for v in value)
    fields.update(pixel_shuffle=True, projection="mlp", projection_norm=True,
                  projection_hidden_size=hf_config.get("projector_hidden_size", 4096))
    return fields


def projector_map() -> TensorMap:
    """The projector's keys (relative to `input_projections.0.`) in an omni checkpoint."""
    return TensorMap({mg: Src(hf) for hf, mg in PROJECTOR.items()}, covers=("",))
