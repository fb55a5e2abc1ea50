"""An energon task encoder for image captioning (and text-only) samples, producing this project's micro-batches.

A sample becomes tokens `[image placeholders..., caption tokens..., eos]`, where each image contributes exactly as
many placeholders as the vision encoder emits tokens for it; the image mode (`FixedTiles`, `DynamicResolution`,
images.py) decides how many and what the encoder's input is.

Batches are dicts: `input_ids`, `labels`, `loss_mask`, `position_ids` as `[B, S]` tensors and `modality_inputs`
`{modality: {encoder name: encoder input}}` (empty when no sample of the batch has an image). Optionally
(`pack_sequences=True`, with energon's `packing_buffer_size`), several samples share one row of `seq_length`
tokens, the B rows are laid end to end as one `[1, B * S]` row (megatron-core's THD format takes batch 1), and
the batch carries `packing_kwargs` for MimoModel (THD cu_seqlens; positions restart per sample).
"""

from __future__ import annotations

import zlib
from typing import Sequence

import torch
from megatron.energon import DefaultTaskEncoder, Sample, SkipSample, edataclass, stateless
from megatron.energon.errors import FatalSampleError

from .images import FixedTiles, ImageMode, to_float_image
from .skips import TOO_LONG, SkippedSampleCounter
from .tokenizer import Tokenizer

__all__ = ["EncodedSample", "MultimodalTaskEncoder"]

MAX_SKIPS_IN_A_ROW = 100  # too-long samples in a row before the data is given up on (energon's error tolerance)


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

