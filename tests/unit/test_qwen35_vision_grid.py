"""Qwen3.5-VL images (providers/qwen35/image_grid.py) against transformers' own image processor for the model
(`Qwen2VLImageProcessor`, what `AutoImageProcessor` gives for `qwen3_5`), instantiated offline from its settings:
the same grid and the same pixel values for images of many sizes (tiny, huge, extreme aspect ratios, below
min_pixels and above max_pixels)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2VLImageProcessor, Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as reference_smart_resize

from mimo.providers.qwen35.image_grid import GridImages, llm_grid_thw, patchify, smart_resize, unpatchify
from mimo.providers.qwen35.vision import Qwen35VisionSettings

# A small processor (4-pixel patches merged 2 x 2: factor 8) keeps the images small; the rules are the same.
SMALL = dict(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=128 * 128)
# (height, width): below min_pixels, above max_pixels, tiny, extreme aspect ratios both ways, sides that round
# half to even (a side of 4 or 12 with factor 8), exact multiples, odd sizes.
SIZES = [(1, 1), (3, 5), (8, 8), (12, 20), (31, 33), (37, 91), (64, 64), (128, 128), (129, 127), (200, 50),
         (500, 300), (1000, 7), (7, 1000), (3, 400), (16, 1000), (1024, 768), (4, 800)]
PIXEL_TOLERANCE = 1e-6  # float rounding of the normalization; the resized 8-bit levels are identical


def uint8_image(height: int, width: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (3, height, width), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8)


@pytest.fixture(scope="module")
def reference():
    return Qwen2VLImageProcessor(**{k: SMALL[k] for k in ("patch_size", "merge_size", "temporal_patch_size")},
                                 size={"shortest_edge": SMALL["min_pixels"], "longest_edge": SMALL["max_pixels"]},
                                 image_mean=[0.5] * 3, image_std=[0.5] * 3)


@pytest.mark.parametrize("size", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
def test_grid_and_pixels_equal_the_processors(reference, size):
    """mimo gets each image as floats in [0, 1] (its decoded images), the processor as uint8."""
    mode = GridImages(**SMALL)
    image = uint8_image(*size, seed=sum(size))
    want = reference(images=[image], return_tensors="pt")
    processed = mode.process(image.float() / 255)
    got = mode.collate([processed])
    assert got["grid_thw"].tolist() == want["image_grid_thw"].tolist()
    assert got["pixel_values"].shape == want["pixel_values"].shape
    assert (got["pixel_values"] - want["pixel_values"]).abs().max() <= PIXEL_TOLERANCE
    (_, gh, gw), = want["image_grid_thw"].tolist()
    assert mode.num_patches(*size) == gh * gw == reference.get_number_of_image_patches(*size)
    assert processed.num_tokens == mode.num_tokens(*size) == gh * gw // 4
    assert processed.size == (gh * 4, gw * 4)


def test_several_images_collate_and_concat_as_the_processor_batches_them(reference):
    mode = GridImages(**SMALL)
    images = [uint8_image(h, w, seed=i) for i, (h, w) in enumerate([(37, 91), (200, 50), (8, 8)])]
    want = reference(images=images, return_tensors="pt")
    processed = [mode.process(im.float() / 255) for im in images]
    got = mode.concat([mode.collate(processed[:1]), mode.collate(processed[1:])])
    assert got["grid_thw"].tolist() == want["image_grid_thw"].tolist()
    assert (got["pixel_values"] - want["pixel_values"]).abs().max() <= PIXEL_TOLERANCE


def test_the_pil_processor_differs_by_its_own_resize_only():
    """transformers' PIL backend resizes with PIL (other rounding): same grids, pixels within one 8-bit level
    (2/255 after normalizing to [-1, 1]). mimo follows the default (torchvision) backend exactly."""
    pil = Qwen2VLImageProcessorPil(**{k: SMALL[k] for k in ("patch_size", "merge_size", "temporal_patch_size")},
                                   size={"shortest_edge": SMALL["min_pixels"],
                                         "longest_edge": SMALL["max_pixels"]}, image_mean=[0.5] * 3,
                                   image_std=[0.5] * 3)
    mode = GridImages(**SMALL)
    image = uint8_image(500, 300, seed=3)
    want = pil(images=[image.permute(1, 2, 0).numpy()], return_tensors="pt")
    got = mode.collate([mode.process(image.float() / 255)])
    assert got["grid_thw"].tolist() == want["image_grid_thw"].tolist()
    assert (got["pixel_values"] - want["pixel_values"]).abs().max() <= 2 / 255 + PIXEL_TOLERANCE


@pytest.mark.parametrize("size", [(1, 1), (10, 10), (224, 224), (256, 256), (480, 640), (1080, 1920),
                                  (4000, 3000), (4096, 4096), (5000, 5000), (8192, 64), (100, 19000),
                                  (20000, 101), (333, 777), (2049, 2047)])
def test_the_qwen_defaults_give_the_references_grid(size):
    """Qwen3.5's own processor settings (16-pixel patches merged 2 x 2, 256^2 to 4096^2 pixels): the grid of
    transformers' smart_resize, for sizes too large to process here."""
    mode = Qwen35VisionSettings(vision_out_hidden_size=4096).image_mode()
    assert (mode.patch_size, mode.merge_size, mode.min_pixels, mode.max_pixels) == (16, 2, 256 ** 2, 4096 ** 2)
    assert mode.resized_size(*size) == reference_smart_resize(*size, factor=32, min_pixels=256 ** 2,
                                                              max_pixels=4096 ** 2)


def test_aspect_ratios_over_200_are_refused_as_the_processor_does():
    with pytest.raises(ValueError, match="absolute aspect ratio"):
        reference_smart_resize(1, 201, factor=8, min_pixels=64, max_pixels=4096)
    with pytest.raises(ValueError, match="aspect ratio 201.0 is over 200"):
        smart_resize(1, 201, 8, 64, 4096)
    assert smart_resize(1, 200, 8, 64, 4096) == reference_smart_resize(1, 200, factor=8, min_pixels=64,
                                                                       max_pixels=4096)


def test_patch_rows_are_in_merge_block_order_and_invert():
    """Rows 0-3 are the first 2 x 2 block of patches (row-major inside it), each row (c, t, y, x) with the image
    repeated over the temporal patch."""
    image = torch.arange(3 * 16 * 24, dtype=torch.float32).reshape(3, 16, 24)
    rows = patchify(image, patch_size=4, merge_size=2, temporal_patch_size=2)
    assert rows.shape == (4 * 6, 3 * 2 * 4 * 4)
    patch = lambda r, c: image[:, 4 * r:4 * r + 4, 4 * c:4 * c + 4]  # noqa: E731
    for row, (r, c) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3)]):
        assert torch.equal(rows[row].view(3, 2, 4, 4), patch(r, c)[:, None].expand(3, 2, 4, 4))
    assert torch.equal(unpatchify(rows, (4, 6), 3, 4, 2, 2), image)


def test_the_llm_grid_is_the_merged_grid():
    assert llm_grid_thw(torch.tensor([[1, 4, 8], [2, 16, 6]]), 2).tolist() == [[1, 2, 4], [2, 8, 3]]


@pytest.mark.parametrize("fields, message", [
    (dict(min_pixels=5000, max_pixels=4000), "min_pixels 5000 is over max_pixels 4000"),
    (dict(min_pixels=10, max_pixels=50), "below one merged patch"),
    (dict(std=(0.5, 0.0, 0.5)), "std positive"),
])
def test_inconsistent_image_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        GridImages(**{**SMALL, **fields})
