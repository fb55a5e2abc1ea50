"""mock-vlm's images_per_sample: each sample with images carries that many (placeholders first, the first image
drawn as the single one was), the encoder's FLOPs and token count scale with it, and settings that leave no text
are refused in one line."""

from __future__ import annotations

import pytest
import torch

from mimo.providers.mock_vlm.data import _task, collate, sample
from mimo.providers.mock_vlm.memory import module_memory
from mimo.providers.mock_vlm.model import forward_flops
from mimo.providers.mock_vlm.settings import IMAGES, MockVLMSettings


def test_samples_carry_their_images_and_placeholders():
    one, three = MockVLMSettings(), MockVLMSettings(images_per_sample=3, image_probability=0.5)
    patterns, captions = _task(one)
    singles = [sample(one, patterns, captions, 0, i) for i in range(8)]
    triples = [sample(three, patterns, captions, 0, i) for i in range(8)]
    assert all(len(s["images"]) == 1 for s in singles)
    assert {len(s["images"]) for s in triples} == {0, 3}  # half the samples are text only
    for single, triple in zip(singles, triples):
        if triple["images"]:  # the same generator: the first image is the single one
            assert torch.equal(triple["images"][0], single["images"][0])
    batch = collate(three, triples)
    images = batch["modality_inputs"][IMAGES]["vit"]["x"]
    placeholders = int((batch["input_ids"] == three.image_token_id).sum())
    assert images.shape[0] == sum(len(s["images"]) for s in triples)
    assert placeholders == images.shape[0] * three.image_tokens


def test_flops_and_memory_count_every_image():
    one, three = MockVLMSettings(), MockVLMSettings(images_per_sample=3)
    assert forward_flops(three)[IMAGES] == pytest.approx(3 * forward_flops(one)[IMAGES], rel=1e-12)
    assert forward_flops(three)["language"] == forward_flops(one)["language"]
    assert module_memory(three)[IMAGES].tokens_per_sample == 3 * module_memory(one)[IMAGES].tokens_per_sample


def test_images_that_leave_no_text_are_refused():
    with pytest.raises(ValueError, match="4 images of 16 tokens take 64, which leaves no text in seq_length 64"):
        MockVLMSettings(images_per_sample=4)
