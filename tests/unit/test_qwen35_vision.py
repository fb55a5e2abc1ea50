"""The Qwen3.5-VL vision tower (providers/qwen35/vision.py) against transformers' `Qwen3_5VisionModel`.

A tiny random `Qwen3_5ForConditionalGeneration` written by transformers (save_pretrained) is read through
hf/vision.py's maps into the provider's tower and patch merger, built from their specs in a world of one; both
encode the same images of different sizes packed into one sequence (mimo's images from its image mode, which
equal the processor's: test_qwen35_vision_grid.py), fp32 on the CPU. Then the modules are exported back through the
same maps, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import relative_error, world_of_one
from megatron.core.transformer.spec_utils import build_module
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from mimo.core.checkpoint.hf import check_folder
from mimo.core.checkpoint.hf_load import global_tensors, load_into
from mimo.core.config import LayoutOptions
from mimo.core.parallel import layout, topology
from mimo.core.run.launch import seed_everything
from mimo.errors import UsageError
from mimo.plugins import LANGUAGE, BuildContext, ModuleShape
from mimo.plugins.kit.safetensors_io import FolderSource
from mimo.plugins.kit.tensor_map import to_hf
from mimo.providers.qwen35.hf import vision as hf_vision
from mimo.providers.qwen35.vision import Qwen35VisionSettings, merger_spec, tower_spec, vision_submodules_spec

# Two blocks of 2 heads of 16 channels (4 rotary frequencies per axis), 4-pixel patches merged 2 x 2, an 8 x 8
# position grid, merged tokens of 48 (the LLM's hidden size).
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
                   spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=64)
TINY_TEXT = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=24, vocab_size=128)
IMAGE_SIZES = [(20, 36), (64, 16), (33, 47), (8, 8)]  # grids 4x8, 16x4, 8x12, 8x8 (8 x 8 is below min_pixels)
IMAGES = "images"
VISUAL = "model.visual."
LLM = ("model.language_model.", "lm_head.")
TOLERANCE = 1e-4  # max |mimo - reference| / max |reference|
ALONE = {"dp_cp_group": None}  # modules outside mimo's model wrapper: their world is this process


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations everywhere (the default init's 0.02 would hide differences in norms and activations)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1:  # norm weights around 1, biases around 0
                p.copy_(1 + 0.2 * noise if "norm" in name and name.endswith("weight") else 0.2 * noise)
            else:
                p.copy_(noise / p[0].numel() ** 0.5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, config.json as a dict, the reference vision model) of a saved tiny random Qwen3.5-VL."""
    folder = tmp_path_factory.mktemp("qwen35")
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TINY_TEXT, vision_config=TINY_VISION)).eval()
    _randomize(model.model.visual, seed=0)
    model.save_pretrained(folder)
    return folder, json.loads((folder / "config.json").read_text()), model.model.visual


@pytest.fixture(scope="module")
def settings(checkpoint):
    _, hf_config, _ = checkpoint
    return Qwen35VisionSettings(**hf_vision.config_fields(hf_config["vision_config"]), min_pixels=16 * 16,
                                max_pixels=64 * 64)


@pytest.fixture(scope="module")
def ctx(settings):
    with world_of_one():
        s = settings
        shapes = {IMAGES: ModuleShape(s.vision_depth, s.vision_hidden_size, s.vision_heads,
                                      num_query_groups=s.vision_heads),
                  LANGUAGE: ModuleShape(1, s.vision_out_hidden_size, 2, num_query_groups=1)}
        parallelism = layout.plan(LayoutOptions(), 1, shapes, micro_batch_size=1)
        topo = topology.build(parallelism, backend="gloo")
        seed_everything(0, tp_rank=0, ep_rank=0, etp_rank=0)
        yield BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections=topo.pg_collections)


def maps(settings):
    return hf_vision.tower_map(settings).prefixed("", VISUAL), hf_vision.merger_map(settings).prefixed("", VISUAL)


@pytest.fixture(scope="module")
def converted(checkpoint, settings, ctx):
    """(tower, merger) holding the checkpoint's weights, every tensor read, none left over."""
    folder = checkpoint[0]
    tower, merger = build_module(tower_spec(settings, ctx, IMAGES)), build_module(merger_spec(settings, ctx, IMAGES))
    tower_map, merger_map = maps(settings)
    with FolderSource(folder) as source:
        # the vision model's tensors are all read; the LLM's belong to the text map
        check_folder("the checkpoint", dataclasses.replace(tower_map.merged(merger_map), ignored=LLM), source)
        for module, tmap in ((tower, tower_map), (merger, merger_map)):
            _, initial, errors = load_into(module, [(tmap, source)], ALONE)
            assert not initial and not errors, (initial, errors)
    return tower.eval(), merger.eval()


def mimo_inputs(settings, sizes, seed: int = 1) -> dict:
    mode = settings.image_mode()
    gen = torch.Generator().manual_seed(seed)
    return mode.collate([mode.process(torch.rand(3, h, w, generator=gen)) for h, w in sizes])


# ------------------------------------------------------------------------------------------------------ parity


def test_packed_images_match_the_reference(checkpoint, settings, converted):
    """Four images of different grids in one packed sequence: every patch's hidden state after the blocks, and
    the merged tokens the LLM gets."""
    reference, (tower, merger) = checkpoint[2], converted
    inputs = mimo_inputs(settings, IMAGE_SIZES)
    assert inputs["grid_thw"].tolist() == [[1, 4, 8], [1, 16, 4], [1, 8, 12], [1, 4, 4]]
    with torch.no_grad():
        want = reference(inputs["pixel_values"], grid_thw=inputs["grid_thw"])
        hidden = tower(**inputs)
        tokens = merger(hidden)
    hidden_error = relative_error(hidden, want.last_hidden_state)
    token_error = relative_error(tokens, want.pooler_output)
    print(f"\nQwen3.5 vision, max relative error: patches {hidden_error:.2e}, merged tokens {token_error:.2e}")
    assert hidden.shape == want.last_hidden_state.shape == (inputs["pixel_values"].shape[0], 32)
    assert tokens.shape == want.pooler_output.shape == (sum(settings.image_mode().num_tokens(*hw)
                                                            for hw in IMAGE_SIZES), 48)
    assert hidden_error <= TOLERANCE and token_error <= TOLERANCE


def test_video_frames_attend_within_their_frame_as_the_reference(checkpoint, converted):
    """A clip of two temporal patches (t = 2) beside an image: each frame is its own attention sequence with the
    clip's positions, as transformers has it."""
    reference, (tower, merger) = checkpoint[2], converted
    grid_thw = torch.tensor([[2, 4, 6], [1, 8, 4]])
    rows = torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = reference(rows, grid_thw=grid_thw).pooler_output
        got = merger(tower(rows, grid_thw))
    assert got.shape == want.shape and relative_error(got, want) <= TOLERANCE


def test_attention_stays_within_each_image(settings, converted):
    """An image's tokens do not depend on what it is packed with."""
    tower, merger = converted
    packed = mimo_inputs(settings, IMAGE_SIZES[:2])
    alone = mimo_inputs(settings, IMAGE_SIZES[:1])
    with torch.no_grad():
        first = merger(tower(**alone))
        together = merger(tower(**packed))[:first.shape[0]]
    assert relative_error(together, first) <= 1e-6


def test_the_modality_trains_end_to_end(settings, ctx):
    """The modality's submodules as the provider builds them (tower, then merger): every parameter gets a
    gradient from the merged tokens."""
    spec = vision_submodules_spec(settings, ctx, IMAGES, "vit")
    modality = spec.module.from_spec(spec)  # as MimoModel builds a modality
    inputs = mimo_inputs(settings, IMAGE_SIZES[:2], seed=3)
    out = modality(encoder_inputs={"vit": inputs})
    assert out.shape == (sum(settings.image_mode().num_tokens(*hw) for hw in IMAGE_SIZES[:2]), 48)
    out.square().mean().backward()
    missing = [n for n, p in modality.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


def test_rotary_angles_stay_fp32_when_the_tower_is_cast(settings, ctx):
    """The loop casts each module to the run's dtype (module.to(bf16)): the rotary frequencies are no buffer it
    would round."""
    from mimo.providers.qwen35.vision import packed_grids

    tower = build_module(tower_spec(settings, ctx, IMAGES))
    packed = packed_grids([(1, 16, 40)], settings.spatial_merge_size)
    before = tower._rotary(packed, "cpu")
    tower.to(torch.bfloat16)
    after = tower._rotary(packed, "cpu")
    assert after.dtype == torch.float32 and torch.equal(after, before)


def test_a_grid_that_does_not_match_the_rows_is_refused(converted):
    tower, _ = converted
    with pytest.raises(ValueError, match="pixel_values has 10 patch rows, grid_thw"):
        tower(torch.zeros(10, 96), torch.tensor([[1, 4, 4]]))


# ------------------------------------------------------------------------------------------------ round trip


def test_export_gives_back_the_checkpoint_bit_for_bit(checkpoint, settings, converted):
    folder = checkpoint[0]
    tower, merger = converted
    exported = {}
    for module, tmap in zip((tower, merger), maps(settings)):
        exported.update(to_hf(tmap, global_tensors(module, ALONE)))
    with FolderSource(folder) as source:
        visual = {n for n in source.names() if n.startswith(VISUAL)}
        assert set(exported) == visual
        for name in visual:
            assert torch.equal(exported[name], source.read(name)), name


def test_the_vision_config_round_trips(checkpoint, settings):
    vision = checkpoint[1]["vision_config"]
    again = hf_vision.vision_config(settings)
    assert {k: again[k] for k in TINY_VISION} == {k: vision[k] for k in TINY_VISION}
    assert hf_vision.config_fields(again) == hf_vision.config_fields(vision)


@pytest.mark.parametrize("field, value", [
    ("in_channels", 4), ("hidden_act", "relu"), ("num_heads", 3), ("patch_size", [4, 8]),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}), ("model_type", "siglip_vision_model"),
])
def test_config_values_the_tower_cannot_express_are_refused(checkpoint, field, value):
    vision = checkpoint[1]["vision_config"]
    with pytest.raises(UsageError, match=f"^Qwen3.5 vision config {field}="):
        hf_vision.config_fields({**vision, field: value})


@dataclasses.dataclass
class WithLanguageModel(Qwen35VisionSettings):
    """A provider's settings, which inherit the vision fields."""

    hidden_size: int = 64


@pytest.mark.parametrize("cls, fields, message", [
    (Qwen35VisionSettings, dict(vision_hidden_size=24, vision_heads=4, vision_out_hidden_size=64), "multiple of 4"),
    (Qwen35VisionSettings, dict(vision_position_embeddings=60, vision_out_hidden_size=64), "no square grid"),
    (Qwen35VisionSettings, dict(), "vision_out_hidden_size: give the patch merger's output size"),
    (WithLanguageModel, dict(vision_out_hidden_size=48), "vision_out_hidden_size 48 differs from hidden_size 64"),
    (WithLanguageModel, dict(min_pixels=4096, max_pixels=1024), "min_pixels 4096 is over max_pixels 1024"),
])
def test_settings_the_tower_cannot_build_are_refused(cls, fields, message):
    with pytest.raises(ValueError, match=message):
        cls(**fields)


def test_the_merger_follows_the_language_models_hidden_size():
    assert WithLanguageModel().vision_output_size == 64
    assert WithLanguageModel(vision_out_hidden_size=64).vision_output_size == 64
    assert hf_vision.vision_config(WithLanguageModel())["out_hidden_size"] == 64
