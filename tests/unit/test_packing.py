"""Sequence packing: several samples share one sequence (THD), and each sample trains as if it were alone.

The same samples go through each built-in provider's model twice, packed and unpacked (fp32, the provider's own
task encoder settings); every sample's summed token loss must agree to 1e-5. Positions restart per sample,
attention and the Mamba scan never cross a sample boundary, so the only differences are float reorderings.
`mimo run` with packing (the default for --data) resumes mid-epoch exactly: tests/multiprocess/test_data_loop.py.
"""

from __future__ import annotations

import pytest
import torch
from megatron.energon import CaptioningSample, SimilarityInterleavedSample, TextSample, VQASample
from PIL import Image, ImageDraw

from helpers import build_mimo_model, world_of_one
from mimo.plugins.data import ByteTokenizer, ConversationTaskEncoder, FixedTiles, chat_template


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


def drawn(width: int, height: int, colour=(200, 40, 40)) -> Image.Image:
    image = Image.new("RGB", (width, height), (240, 240, 240))
    ImageDraw.Draw(image).ellipse((width // 4, height // 4, 3 * width // 4, 3 * height // 4), fill=colour)
    return image


def samples() -> list:
    base = lambda key: dict(__key__=key, __restore_key__=(), __subflavors__={}, __sources__=())  # noqa: E731
    return [
        CaptioningSample(**base("caption"), image=drawn(40, 30), caption="a red disc on a pale ground"),
        VQASample(**base("vqa"), image=drawn(24, 48, (30, 60, 220)), context="What colour is <image> the disc?",
                  answers=["blue"], answer_weights=torch.tensor([1.0])),
        TextSample(**base("text"), text="plain text trains as a document, with no image at all"),
        SimilarityInterleavedSample(**base("doc"), images=[drawn(32, 32), drawn(48, 24, (30, 180, 40))],
                                    texts=["First.", "Then a green one.", "The end."], matched_text_indices=[0, 1]),
        CaptioningSample(**base("short"), image=drawn(30, 30, (240, 220, 30)), caption="yellow"),
    ]


def mock_vlm():
    from mimo.providers import mock_vlm
    from mimo.providers.mock_vlm import MockVLMSettings

    template = chat_template("plain")
    settings = MockVLMSettings(vocab_size=ByteTokenizer(special_tokens=template.special_tokens).vocab_size,
                               seq_length=96)
    tokenizer = ByteTokenizer(vocab_size=settings.vocab_size, special_tokens=template.special_tokens)
    tokenizer.image_token_id = settings.image_token_id
    encoder = dict(tokenizer=tokenizer, template=template, seq_length=settings.seq_length, modality="images",
                   encoder_name="vit", image_mode=FixedTiles(image_size=settings.image_size,
                                                             patch_size=settings.patch_size))
    return mock_vlm, settings, "images", encoder


def nemotron_tiny():
    from mimo.providers import nemotron
    from mimo.providers.nemotron import IMAGES, TINY, NemotronVLMSettings
    from mimo.providers.nemotron.data import image_mode
    from mimo.providers.nemotron.settings import ENCODER
    from mimo.providers.nemotron.tokens import data_tokenizer, template_of

    settings = NemotronVLMSettings(**{**TINY, "seq_length": 128})
    encoder = dict(tokenizer=data_tokenizer(settings), template=template_of(settings),
                   seq_length=settings.seq_length, modality=IMAGES, encoder_name=ENCODER,
                   image_mode=image_mode(settings))
    return nemotron, settings, IMAGES, encoder


def token_losses(model, batch) -> torch.Tensor:
    """Per-token loss times loss mask, flattened in row order."""
    inputs = {k: v for k, v in batch.items() if k != "modality_inputs"}
    with torch.no_grad():
        loss, mask = model(**inputs, modality_inputs=batch["modality_inputs"] or None)
    return (loss * mask).reshape(-1)


@pytest.mark.parametrize("provider", [mock_vlm, nemotron_tiny], ids=["mock-vlm", "nemotron-moe-vlm-tiny"])
def test_packed_and_unpacked_samples_train_alike(world, provider):
    module, settings, modality, encoder_args = provider()
    model = build_mimo_model(module, settings, modality)
    unpacked = ConversationTaskEncoder(**encoder_args)
    packed = ConversationTaskEncoder(**encoder_args, pack_sequences=True)
    encoded = [unpacked.encode_sample(s) for s in samples()]
    row = settings.seq_length

    # unpacked: one sample per row, its tokens at the start
    losses = token_losses(model, unpacked.batch(encoded)).reshape(len(encoded), row)
    alone = {s.__key__: losses[i, :len(s.tokens)].sum().item() for i, s in enumerate(encoded)}

    groups = packed.select_samples_to_pack(encoded)
    assert max(len(g) for g in groups) > 1, "the test must put several samples into one sequence"
    batch = packed.batch([packed.pack_selected_samples(g) for g in groups])
    assert batch["input_ids"].shape == (1, len(groups) * row)  # megatron-core's THD rows: batch 1
    flat = token_losses(model, batch)
    together, offset = {}, 0
    for r, group in enumerate(groups):
        offset = r * row
        for sample in group:
            together[sample.__key__] = flat[offset:offset + len(sample.tokens)].sum().item()
            offset += len(sample.tokens)

    assert together.keys() == alone.keys()
    for key, loss in alone.items():
        assert loss > 0 and together[key] == pytest.approx(loss, rel=1e-5, abs=1e-6), key
