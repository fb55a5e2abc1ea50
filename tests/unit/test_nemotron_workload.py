"""The Nemotron family's synthetic workload where the encoder carries its share (issue 48): several images per
sample, exact patch counts and video clips; their placeholders against RADIO's output, and the FLOP count
(`model_flops`) against torch's FLOP counter on the built encoder and against the patch counts the data draws."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from helpers import build_mimo_model, world_of_one
from mimo.providers import nemotron
from mimo.providers.nemotron import IMAGES, TINY, VARIANTS, NemotronVLMSettings
from mimo.providers.nemotron.data import SyntheticTask
from mimo.providers.nemotron.flops import forward_flops

# forward_flops of the defaults before these settings existed: they must not move
OLD_FIGURES = {
    "nemotron-moe-vlm-52l": {"images": 2363652775204.67, "language": 60216716558336.0},
    "nemotron-moe-vlm-mid": {"images": 1278662023296.6394, "language": 2049831862272.0},
    "nemotron-moe-vlm-tiny": {"images": 3505760.312514055, "language": 81027072.0},
}
SLICE = {**next(v for v in VARIANTS if v.name == "nemotron-moe-vlm-52l").defaults, "hybrid_pattern": "MEMEM*EMEM"}


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


def tiny(**overrides) -> NemotronVLMSettings:
    return NemotronVLMSettings(**{**TINY, **overrides})


def vision_module(settings: NemotronVLMSettings):
    """The vision module (RADIO + projection) of a MimoModel built through the provider's hooks, in eval mode."""
    return build_mimo_model(nemotron, settings, IMAGES).modality_submodules[IMAGES]


def counted_flops(module, inputs: dict) -> int:
    """torch's count of the module's forward; the CPU's flash attention kernel counted as SDPA's formula."""
    cpu_sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    counter = FlopCounterMode(display=False, custom_mapping={
        cpu_sdpa: lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)})
    with counter, torch.no_grad():
        module(encoder_inputs={"radio": inputs})
    return counter.get_total_flops()


# -------------------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize("overrides, message", [
    ({"images_per_sample": 5}, "5 images, up to 16 tokens a sequence, can take 80 tokens, which leaves no text in "
                               "seq_length 80"),
    ({"images_per_sample": 2, "video_frames": 8, "video_temporal_patch_size": 2},
     "2 images and a video of 8 frames (4 sequences of video_temporal_patch_size 2), up to 16 tokens a sequence, "
     "can take 96 tokens, which leaves no text in seq_length 80"),
    ({"images_per_sample": 0}, "images_per_sample 0 and video_frames 0 leave a sample no media"),
    ({"video_frames": 1}, "video_frames 1 is an image, not a clip"),
    ({"patches_per_image": 36, "dynamic_resolution": False}, "patches_per_image 36 needs dynamic_resolution"),
    ({"patches_per_image": 100}, "patches_per_image 100 is outside [min_patches, max_patches] = [16, 64]"),
    ({"patches_per_image": 34}, "patches_per_image 34 has no grid with sides that are multiples of 2"),
])
def test_media_settings_are_checked_in_one_line(overrides, message):
    with pytest.raises(ValueError) as err:
        tiny(seq_length=80, **overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_what_fits_is_accepted():
    s = tiny(seq_length=80, images_per_sample=4)  # 64 image tokens and 16 of text
    assert (s.encoder_sequences, s.max_media_tokens) == (4, 64)
    s = tiny(images_per_sample=0, video_frames=7, video_temporal_patch_size=2, patches_per_image=36)
    assert (s.video_sequences, s.fixed_grid, s.max_media_tokens) == (4, (6, 6), 36)


# ------------------------------------------------------------------------------------------ the data path


@pytest.mark.parametrize("overrides", [
    {"images_per_sample": 3},
    {"images_per_sample": 1, "video_frames": 5, "video_temporal_patch_size": 2},  # tubelets, the last padded
    {"images_per_sample": 0, "video_frames": 3},  # no video embedder: every frame an image
])
def test_every_sequence_fills_its_placeholders(world, overrides):
    """RADIO's output for a micro-batch of such samples has one row per placeholder, and each sample's rows are
    what it gives alone; the encoder-pass concatenation of two micro-batches gives both outputs in order."""
    settings = tiny(**overrides)
    vision = vision_module(settings)
    task = SyntheticTask(settings)
    samples = [task.sample(seed=0, index=i) for i in range(3)]
    batch = task.collate(samples)
    inputs = batch["modality_inputs"][IMAGES]["radio"]
    frames = sum(len(clip) for x in samples for clip in x["clips"])
    assert len(inputs["imgs_sizes"]) == frames == 3 * (settings.images_per_sample + settings.video_frames)
    assert ("num_frames" in inputs) == (settings.video_temporal_patch_size > 1)
    encoder = vision.encoders["radio"]
    with torch.no_grad():
        packed = encoder(**inputs)
        singles = [encoder(**task.collate([x])["modality_inputs"][IMAGES]["radio"]) for x in samples]
    placeholders = (batch["input_ids"] == task.image_id).sum(1).tolist()
    assert [s.shape[0] for s in singles] == placeholders
    assert packed.shape[0] == sum(placeholders) < 3 * settings.seq_length
    torch.testing.assert_close(packed, torch.cat(singles), rtol=1e-4, atol=1e-5)

    halves = [task.collate(part)["modality_inputs"][IMAGES] for part in (samples[:1], samples[1:])]
    merged = nemotron.concat_encoder_inputs(settings, IMAGES, halves)["radio"]
    with torch.no_grad():
        torch.testing.assert_close(encoder(**merged), packed, rtol=1e-4, atol=1e-5)


def test_default_samples_draw_as_before():
    """One image per sample: the first clip is the sample's only image, drawn as the single image was."""
    task = SyntheticTask(tiny())
    sizes = [task.clip_sizes(0, i) for i in range(20)]
    assert all(len(clips) == 1 and len(clips[0]) == 1 for clips in sizes)
    several = SyntheticTask(tiny(images_per_sample=3, video_frames=4))
    more = [several.clip_sizes(0, i) for i in range(20)]
    # the same generator draws the same first image; the others follow it
    assert [clips[0] for clips in more] == [clips[0] for clips in sizes]
    assert all([len(c) for c in clips] == [1, 1, 1, 4] and len(set(clips[3])) == 1 for clips in more)


def test_patches_per_image_is_exact_under_both_grid_rules():
    for rule in ("scaled", "closest"):
        for n in (16, 24, 36, 48, 64):
            s = tiny(patches_per_image=n, image_grid=rule, images_per_sample=2)
            task = SyntheticTask(s)
            image = task.sample(0, 0)["clips"][1][0]
            assert image.grid[0] * image.grid[1] == n and image.num_tokens == n // 4, (rule, n, image.grid)


# ------------------------------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("name", sorted(OLD_FIGURES))
def test_default_settings_give_the_old_figures(name):
    variant = next(v for v in VARIANTS if v.name == name)
    assert forward_flops(NemotronVLMSettings(**variant.defaults)) == OLD_FIGURES[name]


@pytest.mark.parametrize("overrides", [
    {"patches_per_image": 64},
    {"patches_per_image": 24, "images_per_sample": 3},
    {"patches_per_image": 36, "images_per_sample": 2, "video_frames": 5, "video_temporal_patch_size": 2},
    {"patches_per_image": 16, "images_per_sample": 0, "video_frames": 4},
    {"patches_per_image": 48, "projection": "affine", "images_per_sample": 2},
])
def test_encoder_flops_equal_torchs_count_of_the_built_encoder(world, overrides):
    """Exact patch counts: the hook's encoder FLOPs per sample are what torch counts in the vision module's
    forward over a micro-batch of such samples, per sample (to rounding)."""
    settings = tiny(**overrides)
    task = SyntheticTask(settings)
    batch = task.collate([task.sample(seed=0, index=i) for i in range(2)])
    counted = counted_flops(vision_module(settings), batch["modality_inputs"][IMAGES]["radio"])
    assert forward_flops(settings)[IMAGES] == pytest.approx(counted / 2, rel=1e-9)


@pytest.mark.parametrize("overrides", [
    {}, {"images_per_sample": 3, "image_probability": 0.5}, {"video_frames": 6, "video_temporal_patch_size": 2},
])
def test_encoder_flops_are_the_expectation_over_the_drawn_patch_counts(overrides):
    """Drawn patch counts (the 52-layer slice's images): the hook's figure, the expectation of the log-uniform draw,
    is within 10% of the mean over the grids 2000 samples land on (counted with the hook's per-sequence formula at
    each sequence's patch count). The grid rule rounds sides up, so the hook counts 4-7% less here; the tiny
    variant's coarse grids 24% less; patches_per_image is exact."""
    from mimo.plugins.data import clip_tubelets
    from mimo.providers.nemotron.flops import sequence

    settings = NemotronVLMSettings(**{**SLICE, **overrides})
    task = SyntheticTask(settings)
    total, samples = 0.0, 2000
    for index in range(samples):
        for frames in task.clip_sizes(7, index):
            rows, cols = task.mode.grid(*frames[0])
            exact = dataclasses.replace(settings, min_patches=rows * cols, max_patches=rows * cols)
            per_frame = settings.video_temporal_patch_size if len(frames) > 1 else 1
            total += clip_tubelets(len(frames), settings.video_temporal_patch_size) * sequence(exact, per_frame)
    assert 0.9 < forward_flops(settings)[IMAGES] / (total / samples) <= 1.0


@pytest.mark.parametrize("overrides, share", [
    ({}, 0.130),  # the default draw: the encoder a small share
    ({"images_per_sample": 2, "patches_per_image": 4096}, 0.510),  # documents: docs/benchmarks.md's choice
    ({"images_per_sample": 0, "video_frames": 20, "video_temporal_patch_size": 2, "patches_per_image": 1024}, 0.496),
])
def test_the_slice_splits_its_flops_as_documented(overrides, share):
    """docs/benchmarks.md's workloads for the 52-layer slice at seq_length 8192: the encoder's share of a sample's
    forward FLOPs."""
    flops = forward_flops(NemotronVLMSettings(**{**SLICE, **overrides}))
    assert flops[IMAGES] / (flops[IMAGES] + flops["language"]) == pytest.approx(share, abs=0.001)


def test_video_trains_the_video_embedder(world):
    """Fed clips, RADIO's video patch embedder is trained (stage3 freezes it only without video) and gets a
    gradient; images alone leave it frozen, as before."""
    assert not nemotron.frozen_parameters(tiny(video_temporal_patch_size=2, video_frames=4))
    assert any("video_embedder" in p for p in nemotron.frozen_parameters(tiny(video_temporal_patch_size=2)))
    settings = tiny(images_per_sample=1, video_frames=3, video_temporal_patch_size=2)
    vision = vision_module(settings)
    task = SyntheticTask(settings)
    batch = task.collate([task.sample(seed=0, index=i) for i in range(2)])
    vision(encoder_inputs=batch["modality_inputs"][IMAGES]).square().sum().backward()
    radio = vision.encoders["radio"]
    assert radio.video_embedder.weight.grad.abs().sum() > 0 and radio.embedder.weight.grad.abs().sum() > 0
