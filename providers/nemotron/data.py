"""Data for the Nemotron VLM family: synthetic image+caption samples, or (with `--data`) an energon dataset.

Each of `num_classes` classes has a fixed coarse colour pattern and a fixed caption. A sample is an image of its
class (random size and aspect ratio, stretched pattern plus noise; `images_per_sample` of them, and a video clip of
`video_frames` frames, to give the encoder a document's or a video's share of the work) followed by the caption, so
the caption's first token is predictable only from the image and the rest from the text: the loss falls when both
models learn.

Images go through mimo's image modes (`mimo.plugins.data`): with dynamic resolution each keeps its aspect ratio and
becomes `[patches, 3*P*P]` rows of one packed buffer with `imgs_sizes` and a fresh THD PackedSeqParams per
micro-batch; otherwise each is one `image_size` tile. An image takes as many placeholders as the encoder emits
tokens for it (class tokens dropped, pixel shuffle applied). Sample `i` depends only on (seed, i), so every
layout reads the same global batch.

energon: every sample type mimo reads (captions, VQA, interleaved documents, text, crude chat datasets; see
docs/data.md) becomes a conversation in the Nemotron VL prompt format (`chat_template`), tokenized by the
`tokenizer_path` tokenizer (else UTF-8 bytes), loss on the answers only; images go through the same image modes,
each placeholder expanded to its image's token count. The loop's lane loader (`ctx.energon_loader`) reads it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mimo.plugins.data import DynamicResolution, FixedTiles, clip_tokens, collate_clips

from .settings import ENCODER, IMAGES, NemotronVLMSettings
from .tokens import data_tokenizer, image_token_id, template_of, tokenizer_of

_TASK_SEED = 1234  # the task (patterns, captions) is fixed; the run's seed picks the samples
_PATTERN_CELLS = 4  # a class pattern is a 4 x 4 grid of colours, stretched over the image


def image_mode(s: NemotronVLMSettings):
    # the pixel statistics the encoder was trained with (C-RADIO: OpenAI CLIP's), applied where images are tiled
    stats = dict(mean=tuple(s.image_mean), std=tuple(s.image_std))
    if s.dynamic_resolution:
        # the omni processor's grids and bicubic resize: an exported model sees the images as mimo trained on them
        return DynamicResolution(patch_size=s.patch_size, min_patches=s.min_patches, max_patches=s.max_patches,
                                 pixel_shuffle_factor=s.shuffle_factor, grid_rule=s.image_grid,
                                 resample="bicubic" if s.image_grid == "scaled" else "bilinear",
                                 **stats)
    return FixedTiles(image_size=s.image_size, patch_size=s.patch_size, pixel_shuffle_factor=s.shuffle_factor,
                      **stats)


def _captions(s: NemotronVLMSettings, gen: torch.Generator) -> torch.Tensor:
    """[num_classes, seq_length + 1] caption tokens: a tokenized sentence per class, or random text tokens."""
    image_id = image_token_id(s)
    tokenizer = tokenizer_of(s)
    if tokenizer is None:
        captions = torch.randint(0, s.vocab_size - 1, (s.num_classes, s.seq_length + 1), generator=gen)
        return captions + (captions >= image_id).long()  # every id but the image token
    rows = []
    for label in range(s.num_classes):
        ids = tokenizer.encode(f"A picture of pattern number {label}. ")
        rows.append(torch.tensor(ids * (s.seq_length // max(len(ids), 1) + 2))[: s.seq_length + 1])
    return torch.stack(rows)


class SyntheticTask:
    """The fixed task (class patterns and captions) and how a sample and a micro-batch are made from it.

    A sample with media carries `images_per_sample` images and, with `video_frames`, one video clip after them
    (frames of one size, each the class pattern with its own noise); all of one class. Their placeholders come
    first, in that order, each clip taking its frames' tokens as RADIO groups them (mimo.plugins.data.clip_tokens).
    """

    def __init__(self, s: NemotronVLMSettings):
        gen = torch.Generator().manual_seed(_TASK_SEED)
        self.settings, self.mode, self.image_id = s, image_mode(s), image_token_id(s)
        self.patterns = torch.rand(s.num_classes, 3, _PATTERN_CELLS, _PATTERN_CELLS, generator=gen)
        self.captions = _captions(s, gen)

    def _image_size(self, gen: torch.Generator) -> tuple[int, int]:
        """(height, width) in pixels: the fitted grid of a random aspect ratio in [1/2, 2] and a patch count
        log-uniform in [min_patches, max_patches] (fixed tiles: always image_size; patches_per_image: a size the
        image mode gives exactly its grid, drawing nothing)."""
        s = self.settings
        if not s.dynamic_resolution:
            return s.image_size, s.image_size
        if s.fixed_grid is not None:
            # the omni processor's rule rounds a side of whole patches up to even; one pixel less keeps it
            trim = 1 if s.image_grid == "scaled" else 0
            return tuple(side * s.patch_size - trim for side in s.fixed_grid)
        aspect = math.exp((float(torch.rand(1, generator=gen)) * 2 - 1) * math.log(2))
        patches = math.exp(math.log(s.min_patches) + float(torch.rand(1, generator=gen))
                           * (math.log(s.max_patches) - math.log(s.min_patches)))
        rows, cols = self.mode.grid(max(1, round(math.sqrt(patches / aspect) * s.patch_size)),
                                    max(1, round(math.sqrt(patches * aspect) * s.patch_size)))
        return rows * s.patch_size, cols * s.patch_size

    def _draw(self, seed: int, index: int) -> tuple[torch.Generator, int, list[list[tuple[int, int]]]]:
        """Sample `index`'s generator, class and clips' frame sizes (an image is a clip of one frame; none: text
        only), drawn in that order."""
        s = self.settings
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        label = int(torch.randint(s.num_classes, (1,), generator=gen))
        if float(torch.rand(1, generator=gen)) >= s.image_probability:
            return gen, label, []
        clips = [[self._image_size(gen)] for _ in range(s.images_per_sample)]
        if s.video_frames:
            clips.append([self._image_size(gen)] * s.video_frames)
        return gen, label, clips

    def clip_sizes(self, seed: int, index: int) -> list[list[tuple[int, int]]]:
        """(height, width) of every frame of sample `index`'s clips (an image: one frame), without making them
        (bench/encoder_buckets.py)."""
        return self._draw(seed, index)[2]

    def sample(self, seed: int, index: int) -> dict:
        """Tokens [seq_length + 1] (the clips' placeholders first) and the clips: lists of processed frames."""
        s = self.settings
        gen, label, sizes = self._draw(seed, index)
        clips = [[self._frame(label, size, gen) for size in frames] for frames in sizes]
        n = sum(clip_tokens(clip, s.video_temporal_patch_size) for clip in clips)
        tokens = torch.cat([torch.full((n,), self.image_id), self.captions[label, : s.seq_length - n + 1]])
        return {"tokens": tokens, "clips": clips}

    def _frame(self, label: int, size: tuple[int, int], gen: torch.Generator):
        """The class pattern stretched to `size`, plus noise of its own, processed by the image mode."""
        pixels = F.interpolate(self.patterns[label][None], size=size, mode="nearest")[0]
        pixels = (pixels + 0.1 * torch.randn(pixels.shape, generator=gen)).clamp(0, 1)
        return self.mode.process(pixels)

    def collate(self, samples: list[dict]) -> dict:
        """Stack samples into one micro-batch in the layout MimoModel expects."""
        tokens = torch.stack([x["tokens"] for x in samples])  # [b, seq + 1]
        input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        loss_mask = (labels != self.image_id).float()
        batch = {
            "input_ids": input_ids,
            "labels": labels.masked_fill(loss_mask == 0, 0),
            "loss_mask": loss_mask,
            "position_ids": torch.arange(input_ids.shape[1]).expand_as(input_ids).contiguous(),
            "modality_inputs": {},
        }
        clips = [clip for x in samples for clip in x["clips"]]
        if clips:  # collate builds a new PackedSeqParams each time (RADIO shifts its boundaries in place)
            inputs = collate_clips(self.mode, clips, self.settings.video_temporal_patch_size)
            batch["modality_inputs"][IMAGES] = {ENCODER: inputs}
        return batch


def synthetic_batches(s: NemotronVLMSettings, ctx):
    task = SyntheticTask(s)
    for indices in ctx.sample_indices():
        yield task.collate([task.sample(ctx.seed, i) for i in indices])


def prompt_format(s: NemotronVLMSettings):
    """The Nemotron VL prompt format with the settings' tokenizer and image mode: how `--data` is read, and how
    `mimo generate` writes prompts and reads answers."""
    from mimo import PromptFormat

    return PromptFormat(data_tokenizer(s), template_of(s), image_mode(s), IMAGES, ENCODER)


def energon_batches(s: NemotronVLMSettings, ctx):
    """The loop's lane loader over `ctx.data_path` for this rank's lanes (resumable; counts unreadable samples)."""
    from mimo.plugins.data import ConversationTaskEncoder

    fmt = prompt_format(s)
    encoder = ConversationTaskEncoder(fmt.tokenizer, template=fmt.template, reader="the Nemotron VLM",
                                      seq_length=s.seq_length, image_mode=fmt.image_mode, modality=fmt.modality,
                                      encoder_name=fmt.encoder, pack_sequences=ctx.pack_sequences,
                                      segment_multiple=ctx.segment_multiple)
    return ctx.energon_loader(encoder, shuffle_buffer_size=s.shuffle_buffer or None)
