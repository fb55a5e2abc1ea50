"""C-RADIO checkpoints of Hugging Face (providers/nemotron/hf/radio.py) against mimo's vision encoder (providers/nemotron).

A tiny random transformers `RadioModel` is saved as a checkpoint, converted, and loaded into the provider's
`RadioEncoder` through its tensor map by the per-rank loader; both encode the same images (dynamic resolution,
packed; and fixed tiles): the reference normalizes raw pixels itself, mimo gets them from its data path
(`image_mean` / `image_std`). Then the encoder is exported back through the same map and must load into
`RadioModel` bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import build_nemotron_encoder, relative_error, world_of_one
from megatron.core.models.vision.radio import RADIOViTModel
from safetensors.torch import load_file, save_file
from transformers import RadioConfig, RadioModel

from mimo.core.checkpoint.hf import check_folder
from mimo.core.checkpoint.hf_load import global_tensors, load_into
from mimo.plugins.kit.safetensors_io import FolderSource, TensorsSource
from mimo.plugins.kit.tensor_map import to_hf

from mimo.core.parallel import layout, topology
from mimo.core.config import LayoutOptions
from mimo.errors import UsageError
from mimo.plugins import BuildContext
from mimo.plugins.data import DynamicResolution, FixedTiles
from mimo.providers.nemotron.hf import radio
from mimo.providers import nemotron
from mimo.providers.nemotron import ENCODER, IMAGES, TINY, NemotronVLMSettings
from mimo.providers.nemotron.model import _packed_params

# Two layers, 2 heads of 16, MLP 64, 16-pixel patches, a 16 x 16 position grid, 2 class tokens + 1 register.
TINY_RADIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2.0, patch_size=16,
                  max_img_size=256, num_cls_tokens=2, num_registers=1)
IMAGE_SIZES = [(64, 96), (128, 64), (96, 96)]  # (height, width) in pixels: grids 4x6, 8x4, 6x6
TOLERANCE = 1e-4  # max |mimo - reference| / max |reference|
ALONE = {"dp_cp_group": None}  # modules outside mimo's model wrapper: their world is this process


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations everywhere (the default init's 0.02 would hide differences in norms and activations)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lambda1" in name:  # C-RADIO's LayerScale is the identity
                continue
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1:  # norm weights around 1, biases around 0
                p.copy_(1 + 0.2 * noise if name.endswith("norm1.weight") or name.endswith("norm2.weight")
                        else 0.2 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5 if name.endswith("weight") else noise)


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, config.json as a dict, the reference model) of a saved tiny random RadioModel."""
    folder = tmp_path_factory.mktemp("radio")
    model = RadioModel(RadioConfig(**TINY_RADIO)).eval()
    _randomize(model, seed=0)
    model.save_pretrained(folder)
    return folder, json.loads((folder / "config.json").read_text()), model


def settings_for(hf_config: dict, **overrides) -> NemotronVLMSettings:
    # No pixel shuffle: the encoder's rows are the patch features themselves, as the reference's `features` (and
    # a longer sequence, so that an image's unshuffled tokens leave room for text).
    return NemotronVLMSettings(**{**TINY, **radio.config_fields(hf_config), "pixel_shuffle": False,
                                  "seq_length": 128, **overrides})


def build_encoder(settings: NemotronVLMSettings):
    """The provider's RADIO encoder alone, built through its build_encoders hook in a world of one."""
    return build_nemotron_encoder(settings).eval()


def load_strictly(module, tmap, source) -> None:
    """Every tensor of `module` from `source` through `tmap`, nothing left at initialization or left over."""
    check_folder("the checkpoint", tmap, source)
    _, initial, errors = load_into(module, [(tmap, source)], ALONE)
    assert not initial and not errors, (initial, errors)


@pytest.fixture(scope="module")
def converted(world, checkpoint):
    """(settings, encoder) holding the checkpoint's weights, dynamic resolution."""
    folder, hf_config, _ = checkpoint
    settings = settings_for(hf_config)
    encoder = build_encoder(settings)
    with FolderSource(folder) as source:
        load_strictly(encoder, radio.tensor_map(settings, hf_config), source)
    return settings, encoder


def raw_images(seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(3, h, w, generator=gen) for h, w in IMAGE_SIZES]


def reference_patches(image: torch.Tensor, patch: int) -> torch.Tensor:
    """[3, H, W] -> [patches, 3 * P * P]: patches row-major, each (channel, y, x), as transformers' processor."""
    c, h, w = image.shape
    return image.reshape(c, h // patch, patch, w // patch, patch).permute(1, 3, 0, 2, 4).reshape(-1, c * patch ** 2)


# ------------------------------------------------------------------------------------------------------ config


def test_config_fields_are_the_provider_settings(checkpoint):
    _, hf_config, _ = checkpoint
    fields = radio.config_fields(hf_config)
    assert fields == dict(vision_layers=2, vision_hidden_size=32, vision_heads=2, vision_ffn_hidden_size=64,
                          patch_size=16, max_image_size=256, class_tokens=3, vision_layernorm_epsilon=1e-6,
                          vision_activation="gelu", image_mean=radio.CLIP_MEAN, image_std=radio.CLIP_STD,
                          video_temporal_patch_size=1)
    assert radio.config_fields({**hf_config, "hidden_act": "gelu_pytorch_tanh"})["vision_activation"] == "gelu_tanh"
    assert radio.config_fields({"model_type": "radio"})["class_tokens"] == 10  # C-RADIO: 3 class + 7 registers


@pytest.mark.parametrize("field, value", [
    ("use_swiglu_ffn", True), ("qkv_bias", False), ("layerscale_value", 0.5), ("hidden_act", "relu"),
    ("num_channels", 4), ("video_temporal_patch_size", 1), ("max_img_size", 250), ("head_dim", 8),
    ("model_type", "siglip"),
])
def test_config_values_the_provider_cannot_express_are_refused(checkpoint, field, value):
    _, hf_config, _ = checkpoint
    with pytest.raises(UsageError, match=f"^RADIO config {field}={value!r}: "):
        radio.config_fields({**hf_config, field: value})


# ------------------------------------------------------------------------------------------------------ parity


def test_dynamic_resolution_matches_the_reference(checkpoint, converted):
    """Three images of different grids packed into one sequence: every token of the reference (class and
    register tokens included) through RADIOViTModel, and the patch features through the provider's encoder."""
    _, _, reference = checkpoint
    settings, encoder = converted
    p, images = settings.patch_size, raw_images()
    grids = torch.tensor([(h // p, w // p) for h, w in IMAGE_SIZES])
    with torch.no_grad():
        want = reference(torch.cat([reference_patches(im, p) for im in images]), image_grid_hw=grids)

    # mimo's data path normalizes (the settings' image_mean / image_std) and patchifies; the images keep their
    # grids (each lies in [min_patches, max_patches]).
    mode = DynamicResolution(patch_size=p, min_patches=settings.min_patches, max_patches=settings.max_patches,
                             pixel_shuffle_factor=settings.shuffle_factor, mean=settings.image_mean,
                             std=settings.image_std)
    processed = [mode.process(im) for im in images]
    assert [list(x.grid) for x in processed] == grids.tolist()
    inputs = mode.collate(processed)
    lengths = grids.prod(-1).tolist()
    with torch.no_grad():
        every_token = RADIOViTModel.forward(encoder, inputs["x"], None, inputs["imgs_sizes"],
                                            _packed_params(lengths, None, inputs["x"].device))[0]
        features = encoder(**inputs)

    sequence_error = relative_error(every_token, want.last_hidden_state)
    feature_error = relative_error(features, want.features)
    print(f"\nRADIO dynamic resolution, max relative error: all tokens {sequence_error:.2e}, "
          f"patch features {feature_error:.2e}")
    assert every_token.shape == want.last_hidden_state.shape
    assert features.shape == want.features.shape == (sum(lengths), settings.vision_hidden_size)
    assert sequence_error <= TOLERANCE and feature_error <= TOLERANCE


def test_fixed_tiles_match_the_reference(checkpoint, converted):
    """Square tiles smaller than the position grid: the dense path (CPE interpolated to 4x4)."""
    folder, hf_config, reference = checkpoint
    settings = settings_for(hf_config, dynamic_resolution=False, image_size=64)
    encoder = build_encoder(settings)
    result = encoder.load_state_dict(converted[1].state_dict(), strict=False)  # the same weights, fixed tiles
    assert not result.unexpected_keys and all(k.endswith("_extra_state") for k in result.missing_keys)
    tiles = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    mode = FixedTiles(image_size=64, patch_size=16, mean=settings.image_mean, std=settings.image_std)
    with torch.no_grad():
        want = reference(tiles).features.flatten(0, 1)  # [tiles * patches, hidden]
        got = encoder(**mode.collate([mode.process(tile) for tile in tiles]))
    error = relative_error(got, want)
    print(f"\nRADIO fixed tiles, max relative error {error:.2e}")
    assert got.shape == want.shape and error <= TOLERANCE


# ------------------------------------------------------------------------------------------------ round trip


def test_export_loads_into_radio_bit_for_bit(tmp_path, checkpoint, converted):
    folder, hf_config, reference = checkpoint
    settings, encoder = converted
    exported = to_hf(radio.tensor_map(settings, hf_config), global_tensors(encoder, ALONE))
    save_file(exported, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(hf_config))

    original = load_file(folder / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name

    model, info = RadioModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    loaded, want = model.state_dict(), reference.state_dict()
    assert sorted(loaded) == sorted(want)
    for name, tensor in want.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_checkpoint_tensors_the_encoder_cannot_hold_are_refused(checkpoint, converted):
    folder, hf_config, _ = checkpoint
    tmap = radio.tensor_map(converted[0], hf_config)
    state = load_file(folder / "model.safetensors")
    lambda1 = "radio_model.model.blocks.1.layer_scale2.lambda1"
    mean = "radio_model.input_conditioner.norm_mean"
    for changed, message in (({lambda1: state[lambda1] * 2}, "is not all ones"),
                             ({mean: state[mean] + 0.1}, "config.json gives"),
                             ({"radio_model.model.extra.weight": torch.zeros(1)}, "has no place for")):
        with pytest.raises(UsageError, match=message):
            check_folder("DIR", tmap, TensorsSource({**state, **changed}))
    missing = {k: v for k, v in state.items() if "blocks.0.attn.qkv.bias" not in k}
    with pytest.raises(UsageError, match="^DIR has no tensor radio_model.model.blocks.0.attn.qkv.bias"):
        check_folder("DIR", tmap, TensorsSource(missing))


# ------------------------------------------------------------------------ nemotron_h_omni: shuffle and projector

# The omni model around the tiny RADIO (with the video patch embedder omni checkpoints hold): a one-layer
# NemotronH LLM of the tiny variant's width, a projector 4 * 32 -> 40 -> 64.
TINY_TEXT = dict(model_type="nemotron_h", vocab_size=264, hidden_size=64, layers_block_type=["attention"],
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64)


@pytest.fixture(scope="module")
def omni_checkpoint(tmp_path_factory):
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3_Config
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    folder = tmp_path_factory.mktemp("omni")
    config = NemotronH_Omni_Reasoning_V3_Config(
        vision_config={"model_type": "radio", **TINY_RADIO, "video_temporal_patch_size": 2}, text_config=TINY_TEXT,
        vision_hidden_size=32, projector_hidden_size=40, image_token_id=263)
    model = NemotronH_Omni_Reasoning_V3(config).eval()
    _randomize(model.vision_model, seed=3)
    _randomize(model.multi_modal_projector, seed=4)
    model.save_pretrained(folder)
    return folder, json.loads((folder / "config.json").read_text()), model


def test_pixel_shuffle_order_is_the_omni_models(omni_checkpoint):
    from mimo.providers.nemotron.model import pixel_shuffle

    reference = omni_checkpoint[2]
    rows, cols, c = 4, 6, 3
    grid = torch.arange(rows * cols * c, dtype=torch.float32).reshape(rows * cols, c)
    want = reference.pixel_shuffle(grid.view(1, rows, cols, c), scale_factor=0.5).flatten(0, 2)
    assert torch.equal(pixel_shuffle(grid, rows, cols, 2), want)


def test_omni_image_features_entering_the_llm_match_the_reference(world, omni_checkpoint):
    """RADIO, pixel shuffle and projector of a converted omni checkpoint against `get_image_features`; the
    parameter counts of the new settings (video embedder, projector norm) against the built module."""
    from mimo.providers.nemotron.hf import nemotron_h_omni as omni
    from mimo.providers.nemotron.counts import parameter_counts

    folder, hf_config, reference = omni_checkpoint
    settings = NemotronVLMSettings(**{**TINY, **omni.config_fields(hf_config)})
    assert (settings.video_temporal_patch_size, settings.projection_hidden_size) == (2, 40)
    parallelism = layout.plan(LayoutOptions(), 1, nemotron.model_shape(settings), micro_batch_size=1)
    topo = topology.build(parallelism, backend="gloo")
    ctx = BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections=topo.pg_collections)
    spec = nemotron.build_encoders(settings, ctx)[IMAGES].spec
    vision = spec.module.from_spec(spec).eval()  # VisionModalitySubmodules: the encoder and the projection
    assert parameter_counts(settings)[IMAGES].total == sum(p.numel() for p in vision.parameters())
    tmap = radio.tensor_map(settings, omni._vision_config(hf_config), conditioner=False).prefixed(
        f"encoders.{ENCODER}.", "vision_model.").merged(omni.projector_map().prefixed("input_projections.0.", ""))
    with FolderSource(folder) as source:
        tmap.ignored = ("language_model.",)
        load_strictly(vision, tmap, source)

    p, images = settings.patch_size, raw_images(seed=5)
    grids = torch.tensor([(h // p, w // p) for h, w in IMAGE_SIZES])
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in (settings.image_mean, settings.image_std))
    pixels = torch.cat([reference_patches((im - mean) / std, p) for im in images])  # the omni processor's job
    mode = DynamicResolution(patch_size=p, min_patches=settings.min_patches, max_patches=settings.max_patches,
                             pixel_shuffle_factor=settings.shuffle_factor, mean=settings.image_mean,
                             std=settings.image_std)
    with torch.no_grad():
        want = torch.cat(reference.get_image_features(pixels, grids).pooler_output)
        got = vision(encoder_inputs={ENCODER: mode.collate([mode.process(im) for im in images])})
    error = relative_error(got, want)
    print(f"\nomni image features entering the LLM, max relative error {error:.2e}")
    assert got.shape == want.shape == (int(grids.prod(-1).sum()) // 4, TINY_TEXT["hidden_size"])
    assert error <= TOLERANCE

    exported = to_hf(tmap, global_tensors(vision, ALONE))
    original = {name: t for name, t in load_file(folder / "model.safetensors").items()
                if name.startswith(("vision_model.", "mlp1."))}
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("change, message", [
    ({"downsample_ratio": 0.25}, "downsample_ratio=0.25: "),
    ({"text_config": {**TINY_TEXT, "num_nextn_predict_layers": 1}}, "text_config.num_nextn_predict_layers=1: "),
    ({"vision_hidden_size": 48}, "vision_hidden_size=48: "),
])
def test_omni_config_values_the_provider_cannot_express_are_refused(omni_checkpoint, change, message):
    from mimo.providers.nemotron.hf import nemotron_h_omni as omni

    with pytest.raises(UsageError, match=f"^omni config {message}"):
        omni.config_fields({**omni_checkpoint[1], **change})


def test_projection_norm_is_the_same_module_in_both_backends():
    from mimo.providers.nemotron import specs

    te, local = specs.projection_submodules("te", norm=True), specs.projection_submodules("local", norm=True)
    assert (specs.TE_TO_LOCAL[te.linear_fc1], specs.TE_TO_LOCAL[te.linear_fc2]) == (local.linear_fc1,
                                                                                    local.linear_fc2)
