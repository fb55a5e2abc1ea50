"""Data for the Qwen3.5 family: synthetic image + caption samples, or (with `--data`) an energon dataset; and the
prompt format generation renders prompts in.

Synthetic: each of `num_classes` classes has a fixed coarse colour pattern and a fixed caption of CAPTION_TOKENS
random tokens. A sample is `images_per_sample` images of its class (random aspect ratio in [1/2, 2] and size within
the image settings and half the sequence, the stretched pattern plus noise), then the caption repeated to fill
`seq_length`: the first caption token is predictable only from the image, the rest from the caption seen so far,
so the loss falls when both the tower and the LLM learn. Without images (`images_per_sample=0`) a token naming
the class comes first instead. Sample `i` depends only on (seed, i), so every layout reads the same global batch.

Every micro-batch carries Qwen's 3-D positions `[3, B, S]` (positions.py): the image placeholders their grid's,
the text the same value on all three axes. With `--data` the task encoder makes them per sample through its
`positions` hook, so packed rows restart them per sample.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mimo.errors import UsageError

from .positions import MRoPEPositions
from .settings import ENCODER, IMAGES, Qwen35Settings
from .tokens import data_tokenizer, image_token_id, template_of

_TASK_SEED = 1234  # the task (patterns, captions) is fixed; the run's seed picks the samples
_PATTERN_CELLS = 4  # a class pattern is a 4 x 4 grid of colours, stretched over the image
CAPTION_TOKENS = 16


def captions(s: Qwen35Settings, gen: torch.Generator | None = None) -> torch.Tensor:
    """[num_classes, CAPTION_TOKENS] caption ids: above the class markers (ids 0 .. num_classes - 1), never the
    image placeholder."""
    gen = gen or torch.Generator().manual_seed(_TASK_SEED)
    image = image_token_id(s)
    ids = torch.randint(s.num_classes, s.vocab_size - 1, (s.num_classes, CAPTION_TOKENS), generator=gen)
    return ids + (ids >= image).long() if image >= s.num_classes else ids


def largest_image_area(s: Qwen35Settings) -> int:
    """The synthetic images' largest area in pixels: within max_pixels, and the sample's images together take at most
    half the sequence's tokens."""
    budget = s.seq_length // 2 // max(s.images_per_sample, 1)
    return min(s.max_pixels, budget * (s.patch_size * s.spatial_merge_size) ** 2)


class SyntheticTask:
    """The fixed task (class patterns and captions) and how a sample and a micro-batch are made from it."""

    def __init__(self, s: Qwen35Settings):
        gen = torch.Generator().manual_seed(_TASK_SEED)
        self.settings, self.mode, self.image_id = s, s.image_mode(), image_token_id(s)
        self.captions = captions(s, gen)
        self.patterns = torch.rand(s.num_classes, 3, _PATTERN_CELLS, _PATTERN_CELLS, generator=gen)
        self.positions = MRoPEPositions(self.image_id, s.spatial_merge_size)
        self.max_area = largest_image_area(s)
        budget = s.seq_length // 2 // max(s.images_per_sample, 1)
        if s.images_per_sample and self.mode.num_tokens(*self._size(1.0, s.min_pixels)) > budget:
            raise ValueError(f"seq_length {s.seq_length}: {s.images_per_sample} image(s) of min_pixels "
                             f"{s.min_pixels} take more than half the sequence; raise seq_length or lower "
                             f"images_per_sample")

    def _size(self, aspect: float, area: float) -> tuple[int, int]:
        """(height, width) in pixels the image mode gives an image of `area` pixels and width/height `aspect`."""
        return self.mode.resized_size(max(1, round(math.sqrt(area / aspect))), max(1, round(math.sqrt(area * aspect))))

    def _image(self, label: int, gen: torch.Generator):
        """The class pattern stretched over an image of random aspect ratio and size, plus noise, processed; made
        at its resized size (the image mode then does not resize it)."""
        aspect = math.exp((float(torch.rand(1, generator=gen)) * 2 - 1) * math.log(2))
        low, high = math.log(self.settings.min_pixels), math.log(max(self.max_area, self.settings.min_pixels))
        height, width = self._size(aspect, math.exp(low + float(torch.rand(1, generator=gen)) * (high - low)))
        pixels = F.interpolate(self.patterns[label][None], size=(height, width), mode="nearest")[0]
        return self.mode.process((pixels + 0.1 * torch.randn(pixels.shape, generator=gen)).clamp(0, 1))

    def sample(self, seed: int, index: int) -> dict:
        """Tokens [seq_length + 1] (the images' placeholders first) and the processed images."""
        s = self.settings
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        label = int(torch.randint(s.num_classes, (1,), generator=gen))
        images = [self._image(label, gen) for _ in range(s.images_per_sample)]
        head = torch.full((sum(im.num_tokens for im in images),), self.image_id) if images else torch.tensor([label])
        caption = self.captions[label].repeat(s.seq_length // CAPTION_TOKENS + 1)
        return {"tokens": torch.cat([head, caption])[: s.seq_length + 1], "images": images}

    def collate(self, samples: list[dict]) -> dict:
        """One micro-batch in the layout MimoModel reads; position_ids [3, B, S]."""
        tokens = torch.stack([x["tokens"] for x in samples])
        input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        loss_mask = (labels != self.image_id).float()
        positions = torch.stack([self.positions(row, x["images"]) for row, x in zip(input_ids, samples)], dim=1)
        batch = {"input_ids": input_ids, "labels": labels.masked_fill(loss_mask == 0, 0), "loss_mask": loss_mask,
                 "position_ids": positions, "modality_inputs": {}}
        images = [im for x in samples for im in x["images"]]
        if images:
            batch["modality_inputs"][IMAGES] = {ENCODER: self.mode.collate(images)}
        return batch


def synthetic_batches(s: Qwen35Settings, ctx):
    task = SyntheticTask(s)  # here, not in the generator: its refusal comes when the hook is called
    return (task.collate([task.sample(ctx.seed, i) for i in indices]) for indices in ctx.sample_indices())


def prompt_format(s: Qwen35Settings):
    """Prompts for `mimo generate` and `--eval-samples`: the `tokenizer_path` tokenizer, else UTF-8 bytes, in the
    `chat_template` setting's template (a Qwen folder's own ChatML template where it has one); images through the
    processor's grid, and the prompt's 3-D positions as training has them (the answer goes on from the largest)."""
    from mimo import PromptFormat

    return PromptFormat(data_tokenizer(s), template_of(s), image_mode=s.image_mode(), modality=IMAGES,
                        encoder=ENCODER, positions=MRoPEPositions(image_token_id(s), s.spatial_merge_size))


def energon_batches(s: Qwen35Settings, ctx):
    """The loop's lane loader over `ctx.data_path`: every sample type mimo reads as a conversation in the chat
    template, images through the processor's grid (GridImages), 3-D positions per sample."""
    from mimo.plugins.data import ConversationTaskEncoder

    image_id = image_token_id(s)
    encoder = ConversationTaskEncoder(data_tokenizer(s), template=template_of(s), reader="the Qwen3.5 VLM",
                                      seq_length=s.seq_length, image_mode=s.image_mode(), modality=IMAGES,
                                      encoder_name=ENCODER, pack_sequences=ctx.pack_sequences,
                                      segment_multiple=ctx.segment_multiple,
                                      positions=MRoPEPositions(image_id, s.spatial_merge_size))
    return ctx.energon_loader(encoder, shuffle_buffer_size=s.shuffle_buffer or None)


def data_provider(s: Qwen35Settings, ctx):
    try:
        return energon_batches(s, ctx) if ctx.data_path else synthetic_batches(s, ctx)
    except ValueError as err:  # settings the synthetic task cannot fill a sequence with: one line
        raise UsageError(str(err)) from None
