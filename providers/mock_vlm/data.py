"""mock-vlm's data: synthetic image+caption samples, or (with `--data`) an energon captioning dataset.

Synthetic: each of `num_classes` classes has a fixed image pattern and a fixed caption. A sample is a noisy image of one
class (`images_per_sample` of them) followed by that class's caption, so the first caption token is predictable
only from the image and the rest from the text: the loss falls fast when both the encoder and the LLM learn.
Sample `i` depends only on (seed, i), so the same global batch comes out whatever the data-parallel layout.

energon: every sample type mimo reads (captions, VQA, interleaved documents, text, crude chat datasets; see
docs/data.md) becomes a conversation in the `chat_template` setting's format (`plain` by default: no turn
markers), byte-tokenized (so `vocab_size` must hold the byte tokenizer's ids), loss on the answers only; images
become one `image_size` tile each, their placeholder mock-vlm's (the vocabulary's last id). The loop's lane loader
(`ctx.energon_loader`) reads the dataset.
"""

from __future__ import annotations

import torch

from mimo.errors import UsageError

from .settings import IMAGES

_PATTERN_SEED = 1234  # the task itself (patterns and captions) is fixed; the run's seed picks the samples


def _task(settings):
    gen = torch.Generator().manual_seed(_PATTERN_SEED)
    size = settings.image_size
    patterns = torch.rand(settings.num_classes, 3, size, size, generator=gen) * 2 - 1
    # Long enough for a text-only sample; a sample with an image uses the caption's head.
    captions = torch.randint(1, settings.image_token_id, (settings.num_classes, settings.seq_length + 1), generator=gen)
    return patterns, captions


def sample(settings, patterns, captions, seed: int, index: int) -> dict:
    """One sample: tokens [seq_length] (image placeholders first when it has images) and its images (none, or
    images_per_sample noisy copies of its class pattern)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    label = int(torch.randint(settings.num_classes, (1,), generator=gen))
    has_image = bool(torch.rand(1, generator=gen) < settings.image_probability)
    count = settings.images_per_sample if has_image else 0
    image_len = count * settings.image_tokens
    text = captions[label, : settings.seq_length - image_len + 1]
    tokens = torch.cat([torch.full((image_len,), settings.image_token_id), text])
    images = [patterns[label] + 0.1 * torch.randn(patterns[label].shape, generator=gen) for _ in range(count)]
    return {"tokens": tokens, "images": images, "image_len": image_len}


def collate(settings, samples: list[dict]) -> dict:
    """Stack samples into one micro-batch in the layout MimoModel expects."""
    tokens = torch.stack([s["tokens"] for s in samples])  # [b, seq + 1]
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    loss_mask = (labels != settings.image_token_id).float()
    labels = labels.masked_fill(loss_mask == 0, 0)
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": torch.arange(settings.seq_length).expand_as(input_ids).contiguous(),
        "modality_inputs": {},
    }
    images = [image for s in samples for image in s["images"]]
    if images:
        batch["modality_inputs"][IMAGES] = {"vit": {"x": torch.stack(images)}}
    return batch


def synthetic_batches(settings, ctx):
    patterns, captions = _task(settings)
    for indices in ctx.sample_indices():
        yield collate(settings, [sample(settings, patterns, captions, ctx.seed, i) for i in indices])


def prompt_format(settings):
    """Text as bytes in the `chat_template` setting's format, images as one `image_size` tile each with mock-vlm's
    placeholder: how `--data` is read, and how `mimo generate` writes prompts and reads answers."""
    from mimo import PromptFormat
    from mimo.plugins.data import ByteTokenizer, FixedTiles, chat_template

    template = chat_template(settings.chat_template)
    needed = ByteTokenizer(special_tokens=template.special_tokens).vocab_size
    if settings.vocab_size < needed:
        raise UsageError(f"mock-vlm reads --data text as bytes, which with the {template.name} chat template needs "
                         f"vocab_size >= {needed}: --set vocab_size={needed} (it is {settings.vocab_size})")
    tokenizer = ByteTokenizer(vocab_size=settings.vocab_size, special_tokens=template.special_tokens)
    tokenizer.image_token_id = settings.image_token_id  # the placeholder the model's encoder was built with
    return PromptFormat(tokenizer, template, FixedTiles(image_size=settings.image_size, patch_size=settings.patch_size),
                        IMAGES, "vit")


def energon_batches(settings, ctx):
    """The lane loader over `ctx.data_path` for this rank's lanes (resumable; counts unreadable samples)."""
    from mimo.plugins.data import ConversationTaskEncoder

    fmt = prompt_format(settings)
    encoder = ConversationTaskEncoder(
        fmt.tokenizer, template=fmt.template, reader="mock-vlm", seq_length=settings.seq_length,
        modality=fmt.modality, encoder_name=fmt.encoder, image_mode=fmt.image_mode,
        # megatron-core's unfused DotProductAttention (attention=local) takes no packed sequences
        pack_sequences=ctx.pack_sequences and settings.attention == "sdpa", segment_multiple=ctx.segment_multiple)
    return ctx.energon_loader(encoder, shuffle_buffer_size=settings.shuffle_buffer or None)
