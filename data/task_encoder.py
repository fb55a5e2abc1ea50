"""An energon task encoder for image captioning (and text-only) samples, producing this project's micro-batches.

A sample becomes tokens `[image placeholders..., caption tokens..., eos]`, where each image contributes exactly as
many placeholders as the vision encoder emits tokens for it. Two image modes:

* `FixedTiles`: the image is resized to `image_size` x `image_size` and normalized; one tile gives
  `tile_num_tokens(image_size, patch_size, pixel_shuffle_factor)` tokens. The encoder input is
  `{"x": FloatTensor[N_images, 3, H, W]}`.
* `DynamicResolution`: the image keeps its aspect ratio and is resized so that its patch grid `(h_patches,
  w_patches)` has between `min_patches` and `max_patches` patches (each side a multiple of the patch size), then cut
  into `[num_patches, C*P*P]` patch rows (patch-row-major, each row `(c, y, x)` flattened, as megatron-core's RADIO
  patchifies). The encoder input is one packed buffer: `{"x": [1, total_patches, C*P*P], "imgs_sizes":
  LongTensor[N, 2], "packed_seq_params": PackedSeqParams(thd, cumulative patch counts)}`.

Batches are dicts: `input_ids`, `labels`, `loss_mask`, `position_ids` as `[B, S]` tensors and `modality_inputs`
`{modality: {encoder name: encoder input}}` (empty when no sample of the batch has an image). Optionally
(`pack_sequences=True`, with energon's `packing_buffer_size`), several samples share one row of `seq_length`
tokens, the B rows are laid end to end as one `[1, B * S]` row (megatron-core's THD format takes batch 1), and
the batch carries `packing_kwargs` for MimoModel (THD cu_seqlens; positions restart per sample).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal, Sequence

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.energon import DefaultTaskEncoder, Sample, SkipSample, edataclass, stateless
from megatron.energon.errors import FatalSampleError

from .skips import TOO_LONG, SkippedSampleCounter
from .tokenizer import Tokenizer

__all__ = [
    "DynamicResolution", "EncodedSample", "FixedTiles", "MultimodalTaskEncoder", "ProcessedImage",
    "dynamic_num_tokens", "fit_patch_grid", "patchify", "tile_num_tokens", "to_float_image",
]

SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)
MAX_SKIPS_IN_A_ROW = 100  # too-long samples in a row before the data is given up on (energon's error tolerance)


# ---------------------------------------------------------------------------------------------------------------
# Token counts and image geometry


def _shuffle_side(pixel_shuffle_factor: int) -> int:
    side = math.isqrt(pixel_shuffle_factor)
    if pixel_shuffle_factor < 1 or side * side != pixel_shuffle_factor:
        raise ValueError(f"pixel_shuffle_factor must be a perfect square >= 1 (1, 4, 9, ...), "
                         f"got {pixel_shuffle_factor}")
    return side


def tile_num_tokens(image_size: int, patch_size: int, pixel_shuffle_factor: int = 1) -> int:
    """Tokens one `image_size` x `image_size` tile gives: `(image_size / patch_size)^2 / pixel_shuffle_factor`."""
    if image_size <= 0 or patch_size <= 0 or image_size % patch_size:
        raise ValueError(f"image_size {image_size} must be a positive multiple of patch_size {patch_size}")
    grid = image_size // patch_size
    side = _shuffle_side(pixel_shuffle_factor)
    if grid % side:
        raise ValueError(f"a {grid}x{grid} patch grid cannot be pixel-shuffled by {pixel_shuffle_factor}")
    return grid * grid // pixel_shuffle_factor


def dynamic_num_tokens(h_patches: int, w_patches: int, pixel_shuffle_factor: int = 1) -> int:
    """Tokens an image with an `h_patches` x `w_patches` patch grid gives."""
    side = _shuffle_side(pixel_shuffle_factor)
    if h_patches <= 0 or w_patches <= 0 or h_patches % side or w_patches % side:
        raise ValueError(f"patch grid {h_patches}x{w_patches} is not a positive multiple of {side} per side")
    return h_patches * w_patches // pixel_shuffle_factor


@lru_cache(maxsize=4096)
def fit_patch_grid(height: int, width: int, patch_size: int, min_patches: int, max_patches: int,
                   step: int = 1) -> tuple[int, int]:
    """The patch grid `(h_patches, w_patches)` for an image of `height` x `width` pixels.

    Both sides are multiples of `step` (in patches) and `min_patches <= h * w <= max_patches`. Among those grids it
    picks the one closest to the image's aspect ratio and to its native patch count (clamped into the range), both
    measured in log space; an image whose native grid already fits is only rounded to whole patches.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if not 1 <= min_patches <= max_patches:
        raise ValueError(f"need 1 <= min_patches <= max_patches, got {min_patches}, {max_patches}")
    aspect = width / height
    native = (height / patch_size) * (width / patch_size)
    target = min(max(native, min_patches), max_patches)
    log_aspect, log_target = math.log(aspect), math.log(target)
    best, best_err = None, math.inf
    for hp in range(step, max_patches // step * step + 1, step):
        lo = -(-max(min_patches, 1) // hp)  # ceil
        lo = -(-lo // step) * step
        hi = max_patches // hp // step * step
        lo = max(lo, step)
        if lo > hi:
            continue
        ideal = target / hp
        # two candidates for w: the one keeping the area and the one keeping the aspect ratio
        for w_float in (ideal, hp * aspect):
            for wp in {int(math.floor(w_float / step)) * step, int(math.ceil(w_float / step)) * step}:
                wp = min(max(wp, lo), hi)
                err = abs(math.log(wp / hp) - log_aspect) + abs(math.log(hp * wp) - log_target)
                if err < best_err - 1e-12:
                    best, best_err = (hp, wp), err
    if best is None:
        raise ValueError(f"no patch grid with sides that are multiples of {step} has between {min_patches} and "
                         f"{max_patches} patches")
    return best


def patchify(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """`[C, H, W]` -> `[(H/P) * (W/P), C*P*P]`: patches in row-major order, each flattened as (c, y, x)."""
    c, h, w = image.shape
    if h % patch_size or w % patch_size:
        raise ValueError(f"image {h}x{w} is not a multiple of patch size {patch_size}")
    hp, wp = h // patch_size, w // patch_size
    x = image.reshape(c, hp, patch_size, wp, patch_size)
    return x.permute(1, 3, 0, 2, 4).reshape(hp * wp, c * patch_size * patch_size)


def to_float_image(image: Any) -> torch.Tensor:
    """An image as `float32 [3, H, W]` in [0, 1]: from energon's decoded tensor (float or uint8), a PIL image or a
    `[H, W, C]` numpy array. Grey images are repeated to RGB; an alpha channel is dropped."""
    if not isinstance(image, torch.Tensor):
        try:
            from PIL import Image
        except ImportError:  # pragma: no cover - PIL ships with energon's image decoding
            Image = None
        if Image is not None and isinstance(image, Image.Image):
            import numpy as np

            image = torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)
        else:
            image = torch.as_tensor(image)
            if image.ndim == 3 and image.shape[-1] in (1, 3, 4) and image.shape[0] not in (1, 3, 4):
                image = image.permute(2, 0, 1)
    if image.ndim == 2:
        image = image[None]
    if image.ndim != 3:
        raise ValueError(f"expected an image [C, H, W], got shape {tuple(image.shape)}")
    if image.dtype == torch.uint8:
        image = image.float() / 255.0
    else:
        image = image.float()
    if image.shape[0] == 1:
        image = image.expand(3, -1, -1)
    elif image.shape[0] == 4:
        image = image[:3]
    elif image.shape[0] != 3:
        raise ValueError(f"expected 1, 3 or 4 channels, got {image.shape[0]}")
    return image


def _resize(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    if tuple(image.shape[-2:]) == (height, width):
        return image
    return F.interpolate(image[None], size=(height, width), mode="bilinear", align_corners=False,
                         antialias=True)[0]


def _normalize(image: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    m = torch.tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    s = torch.tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return (image - m) / s


# ---------------------------------------------------------------------------------------------------------------
# Image modes


@dataclass
class ProcessedImage:
    pixels: torch.Tensor  # fixed tiles: [tiles, 3, S, S]; dynamic resolution: [num_patches, C*P*P]
    grid: tuple[int, int]  # patch grid (h_patches, w_patches) of one tile / of the image
    num_tokens: int  # placeholders this image takes in the token sequence
    size: tuple[int, int]  # (height, width) in pixels after resizing


@dataclass(frozen=True)
class FixedTiles:
    """Every image becomes one `image_size` x `image_size` tile."""

    image_size: int = 32
    patch_size: int = 8
    pixel_shuffle_factor: int = 1
    mean: tuple[float, ...] = SIGLIP_MEAN
    std: tuple[float, ...] = SIGLIP_STD
    kind: Literal["fixed"] = field(default="fixed", init=False)

    def __post_init__(self):
        tile_num_tokens(self.image_size, self.patch_size, self.pixel_shuffle_factor)  # validates

    @property
    def tokens_per_tile(self) -> int:
        return tile_num_tokens(self.image_size, self.patch_size, self.pixel_shuffle_factor)

    def num_tokens(self, height: int, width: int) -> int:
        return self.tokens_per_tile

    def process(self, image: torch.Tensor) -> ProcessedImage:
        tile = _normalize(_resize(image, self.image_size, self.image_size), self.mean, self.std)
        g = self.image_size // self.patch_size
        return ProcessedImage(pixels=tile[None], grid=(g, g), num_tokens=self.tokens_per_tile,
                              size=(self.image_size, self.image_size))

    def collate(self, images: list[ProcessedImage]) -> dict:
        return {"x": torch.cat([p.pixels for p in images], dim=0)}


@dataclass(frozen=True)
class DynamicResolution:
    """Every image keeps its aspect ratio; its patch count lies in `[min_patches, max_patches]`.

    `imgs_sizes` in the encoder input is per image `(height, width)` in pixels (megatron-core's RADIO convention:
    it derives the patch counts as `imgs_sizes // patch_size`), or `(h_patches, w_patches)` with
    `imgs_sizes_unit="patches"`.
    """

    patch_size: int = 8
    min_patches: int = 4
    max_patches: int = 64
    pixel_shuffle_factor: int = 1
    mean: tuple[float, ...] = SIGLIP_MEAN
    std: tuple[float, ...] = SIGLIP_STD
    imgs_sizes_unit: Literal["pixels", "patches"] = "pixels"
    kind: Literal["dynamic"] = field(default="dynamic", init=False)

    def __post_init__(self):
        if self.patch_size <= 0:
            raise ValueError(f"patch_size must be positive, got {self.patch_size}")
        if self.imgs_sizes_unit not in ("pixels", "patches"):
            raise ValueError(f"imgs_sizes_unit must be 'pixels' or 'patches', got {self.imgs_sizes_unit!r}")
        fit_patch_grid(1, 1, self.patch_size, self.min_patches, self.max_patches, self.step)  # validates

    @property
    def step(self) -> int:
        return _shuffle_side(self.pixel_shuffle_factor)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        return fit_patch_grid(int(height), int(width), self.patch_size, self.min_patches, self.max_patches,
                              self.step)

    def num_tokens(self, height: int, width: int) -> int:
        return dynamic_num_tokens(*self.grid(height, width), self.pixel_shuffle_factor)

    def process(self, image: torch.Tensor) -> ProcessedImage:
        hp, wp = self.grid(image.shape[-2], image.shape[-1])
        h, w = hp * self.patch_size, wp * self.patch_size
        pixels = _normalize(_resize(image, h, w), self.mean, self.std)
        return ProcessedImage(pixels=patchify(pixels, self.patch_size), grid=(hp, wp),
                              num_tokens=dynamic_num_tokens(hp, wp, self.pixel_shuffle_factor), size=(h, w))

    def collate(self, images: list[ProcessedImage]) -> dict:
        counts = [p.pixels.shape[0] for p in images]
        cu = torch.zeros(len(counts) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0).to(torch.int32)
        sizes = [p.size if self.imgs_sizes_unit == "pixels" else p.grid for p in images]
        return {
            "x": torch.cat([p.pixels for p in images], dim=0)[None],
            "imgs_sizes": torch.tensor(sizes, dtype=torch.long).reshape(len(images), 2),
            "packed_seq_params": PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(),
                                                 max_seqlen_q=max(counts), max_seqlen_kv=max(counts)),
        }


ImageMode = FixedTiles | DynamicResolution


# ---------------------------------------------------------------------------------------------------------------
# Samples


@edataclass
class EncodedSample(Sample):
    """One encoded sample (or, with sequence packing, several samples sharing one row)."""

    #: token ids `[L]` (L <= seq_length): image placeholders first, then the text
    tokens: torch.Tensor
    #: next-token targets `[L]`; positions without a target hold the pad id
    labels: torch.Tensor
    #: `[L]` 1.0 where `labels` is a text token to learn
    loss_mask: torch.Tensor
    #: `[L]` position of each token within its own sample
    position_ids: torch.Tensor
    #: the sample's images, in placeholder order
    images: list
    #: lengths of the samples packed in this row (one entry when not packed)
    seqlens: list


class MultimodalTaskEncoder(DefaultTaskEncoder):
    """Turns CaptioningSamples (or any sample with an `image`/`images` and a `caption`/`text`) into micro-batches.

    Args:
        tokenizer: `encode`, `pad_id`, `eos_id`, `image_token_id` (see `tokenizer.py`).
        seq_length: token budget of a sample (and the padded row length of a batch).
        image_mode: `FixedTiles(...)` or `DynamicResolution(...)`.
        encoder_name / modality: where the encoder input goes: `modality_inputs[modality][encoder_name]`.
        skip_counter: a `SkippedSampleCounter`; samples dropped for not fitting are recorded there.
        min_text_tokens: a sample whose image tokens leave fewer text tokens than this is skipped.
        pad_to_longest: pad a batch to its longest row (rounded up to `pad_multiple`) instead of `seq_length`.
        pack_sequences: pack several samples into one row (needs `packing_buffer_size` in energon's
            `get_train_dataset`); the batch then carries `packing_kwargs` (THD) for the language model.
    """

    def __init__(self, tokenizer: Tokenizer, *, seq_length: int, image_mode: ImageMode | None = None,
                 encoder_name: str = "vit", modality: str = "images",
                 skip_counter: SkippedSampleCounter | None = None, min_text_tokens: int = 1,
                 pad_to_longest: bool = False, pad_multiple: int = 1, pack_sequences: bool = False):
        super().__init__()
        if seq_length < 2:
            raise ValueError(f"seq_length must be >= 2, got {seq_length}")
        if min_text_tokens < 1:
            raise ValueError("min_text_tokens must be >= 1: a sample needs a token to learn")
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.image_mode = image_mode if image_mode is not None else FixedTiles()
        self.encoder_name = encoder_name
        self.modality = modality
        self.skip_counter = skip_counter
        self.min_text_tokens = min_text_tokens
        self.pad_to_longest = pad_to_longest
        self.pad_multiple = max(1, pad_multiple)
        self.pack_sequences = pack_sequences
        self._skips_in_a_row = 0  # in this process (a worker's copy counts its own)

    # -- per sample ---------------------------------------------------------------------------------------------

    @staticmethod
    def _images_of(sample) -> list:
        for name in ("image", "images"):
            value = sample.get(name) if isinstance(sample, dict) else getattr(sample, name, None)
            if value is None:
                continue
            if isinstance(value, (list, tuple)):
                return [v for v in value if v is not None]
            if isinstance(value, torch.Tensor) and value.ndim == 4:
                return list(value)
            return [value]
        return []

    @staticmethod
    def _text_of(sample) -> str:
        for name in ("caption", "text"):
            value = sample.get(name) if isinstance(sample, dict) else getattr(sample, name, None)
            if value is not None:
                return value if isinstance(value, str) else str(value)
        return ""

    def _skip(self, sample, message: str):
        key = sample.get("__key__") if isinstance(sample, dict) else getattr(sample, "__key__", None)
        if self.skip_counter is not None:
            self.skip_counter.record(key, TOO_LONG, message)
        # energon never gives up on skipped samples: a dataset none of whose samples fits would read forever
        self._skips_in_a_row += 1
        if self._skips_in_a_row >= MAX_SKIPS_IN_A_ROW:
            raise FatalSampleError.from_sample(
                sample, f"{self._skips_in_a_row} samples in a row do not fit seq_length {self.seq_length} (the "
                        f"last: {key}: {message}); raise seq_length")
        raise SkipSample(message)

    def encode_tokens(self, text: str, image_tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
        """(tokens, labels, loss_mask) for images taking `image_tokens` placeholders each and `text`.

        The text tail is cut to fit `seq_length`; image placeholders are never cut (callers skip a sample whose
        images leave fewer than `min_text_tokens` tokens).
        """
        tok = self.tokenizer
        n_img = sum(image_tokens)
        text_ids = list(tok.encode(text)) + [tok.eos_id]
        text_ids = text_ids[: max(0, self.seq_length - n_img)]
        tokens = torch.tensor([tok.image_token_id] * n_img + text_ids, dtype=torch.long)
        labels = torch.full_like(tokens, tok.pad_id)
        labels[:-1] = tokens[1:]
        loss_mask = torch.zeros(len(tokens), dtype=torch.float32)
        # learn every next token that is text: the last image position predicts the first caption token
        loss_mask[:-1] = (tokens[1:] != tok.image_token_id).float()
        labels = labels.masked_fill(loss_mask == 0, tok.pad_id)
        return tokens, labels, loss_mask

    @stateless
    def encode_sample(self, sample) -> EncodedSample:
        images = [to_float_image(im) for im in self._images_of(sample)]
        counts = [self.image_mode.num_tokens(im.shape[-2], im.shape[-1]) for im in images]
        if sum(counts) + self.min_text_tokens > self.seq_length:
            self._skip(sample, f"{sum(counts)} image tokens leave less than {self.min_text_tokens} of "
                               f"{self.seq_length} tokens for text")
        self._skips_in_a_row = 0
        processed = [self.image_mode.process(im) for im in images]
        assert [p.num_tokens for p in processed] == counts
        tokens, labels, loss_mask = self.encode_tokens(self._text_of(sample), counts)
        return self._encoded(sample, tokens, labels, loss_mask, processed)

    @staticmethod
    def _encoded(sample, tokens, labels, loss_mask, images: list) -> EncodedSample:
        """One sample's row, keeping the sample's key and restore key (an energon Sample or a raw dict)."""
        fields = dict(tokens=tokens, labels=labels, loss_mask=loss_mask,
                      position_ids=torch.arange(len(tokens), dtype=torch.long), images=images,
                      seqlens=[len(tokens)])
        if isinstance(sample, Sample):
            return EncodedSample.derive_from(sample, **fields)
        return EncodedSample(__key__=sample.get("__key__", ""), __restore_key__=sample.get("__restore_key__", ()),
                             **fields)

    # -- sequence packing (energon calls these when get_train_dataset(..., packing_buffer_size=N)) ----------------

    def select_samples_to_pack(self, samples: list[EncodedSample]) -> list[list[EncodedSample]]:
        """First-fit decreasing: groups of samples whose lengths add up to at most `seq_length`, in an order that
        does not follow their lengths (energon yields them in this order: longest first would give each buffer's
        first micro-batches its longest samples)."""
        if not self.pack_sequences:
            return [[s] for s in samples]
        bins: list[tuple[int, list[EncodedSample]]] = []
        for s in sorted(samples, key=lambda s: -len(s.tokens)):
            n = len(s.tokens)
            for i, (used, group) in enumerate(bins):
                if used + n <= self.seq_length:
                    bins[i] = (used + n, group + [s])
                    break
            else:
                bins.append((n, [s]))
        # a fixed order (resumes re-make it) from the samples' keys
        return sorted((group for _, group in bins),
                      key=lambda group: zlib.crc32(",".join(str(s.__key__) for s in group).encode()))

    @stateless
    def pack_selected_samples(self, samples: list[EncodedSample]) -> EncodedSample:
        if len(samples) == 1:
            return samples[0]
        return EncodedSample(
            __key__=",".join(s.__key__ for s in samples),
            __restore_key__=(),
            __sources__=tuple(src for s in samples for src in (s.__sources__ or ())),
            tokens=torch.cat([s.tokens for s in samples]),
            labels=torch.cat([s.labels for s in samples]),  # a sample's last label is already masked
            loss_mask=torch.cat([s.loss_mask for s in samples]),
            position_ids=torch.cat([s.position_ids for s in samples]),
            images=[im for s in samples for im in s.images],
            seqlens=[n for s in samples for n in s.seqlens],
        )

    # -- batching -----------------------------------------------------------------------------------------------

    def _row_length(self, samples: list[EncodedSample]) -> int:
        if not self.pad_to_longest:
            return self.seq_length
        longest = max(len(s.tokens) for s in samples)
        return min(self.seq_length, -(-longest // self.pad_multiple) * self.pad_multiple)

    @stateless
    def batch(self, samples: list[EncodedSample]) -> dict:
        tok = self.tokenizer
        b, s = len(samples), self._row_length(samples)
        input_ids = torch.full((b, s), tok.pad_id, dtype=torch.long)
        labels = torch.full((b, s), tok.pad_id, dtype=torch.long)
        loss_mask = torch.zeros((b, s), dtype=torch.float32)
        position_ids = torch.arange(s, dtype=torch.long).repeat(b, 1)
        for i, sample in enumerate(samples):
            n = len(sample.tokens)
            if n > s:
                raise ValueError(f"sample {sample.__key__} has {n} tokens, more than the row length {s}")
            input_ids[i, :n] = sample.tokens
            labels[i, :n] = sample.labels
            loss_mask[i, :n] = sample.loss_mask
            if self.pack_sequences:
                position_ids[i, :n] = sample.position_ids
                # padding continues the row's last sequence (it is that sequence's padded tail in packing_kwargs)
                last = int(sample.position_ids[-1]) + 1 if n else 0
                position_ids[i, n:] = torch.arange(last, last + s - n)
        out = {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
               "modality_inputs": {}}
        images = [im for sample in samples for im in sample.images]
        if images:
            out["modality_inputs"] = {self.modality: {self.encoder_name: self.image_mode.collate(images)}}
        if self.pack_sequences:
            # megatron-core's THD path takes the packed batch as one row (batch 1), sequences laid end to end
            for key in ("input_ids", "labels", "loss_mask", "position_ids"):
                out[key] = out[key].reshape(1, b * s)
            out["packing_kwargs"] = self._packing_kwargs(samples, s)
        return out

    @staticmethod
    def _packing_kwargs(samples: list[EncodedSample], row: int) -> dict:
        """THD cu_seqlens over the batch flattened to `[B * row]`: each row's padding joins its last sequence in
        the padded boundaries (an empty row is one padded sequence of length 0). `total_tokens` lets megatron-core
        derive each token's sequence index (`seq_idx`, which mamba-ssm's kernels read)."""
        lengths, padded = [], []
        for sample in samples:
            seqlens = list(sample.seqlens) or [0]
            lengths += seqlens
            padded += seqlens[:-1] + [seqlens[-1] + row - sum(seqlens)]
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
        cu_p = torch.zeros(len(padded) + 1, dtype=torch.int32)
        cu_p[1:] = torch.tensor(padded, dtype=torch.int64).cumsum(0).to(torch.int32)
        return {
            "cu_seqlens_q": cu, "cu_seqlens_kv": cu.clone(), "cu_seqlens_q_padded": cu_p,
            "cu_seqlens_kv_padded": cu_p.clone(),
            "max_seqlen_q": torch.tensor(max(padded), dtype=torch.int32),
            "max_seqlen_kv": torch.tensor(max(padded), dtype=torch.int32),
            "total_tokens": len(samples) * row,
        }

