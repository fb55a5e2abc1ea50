"""An energon task encoder for image captioning (and text-only) samples, producing this project's micro-batches.

A sample becomes tokens `[image placeholders..., caption tokens..., eos]`, where each image contributes exactly as
many placeholders as the vision encoder emits tokens for it; the image mode (`FixedTiles`, `DynamicResolution`,
images.py) decides how many and what the encoder's input is.

Batches are dicts: `input_ids`, `labels`, `loss_mask`, `position_ids` as `[B, S]` tensors and `modality_inputs`
`{modality: {encoder name: encoder input}}` (empty when no sample of the batch has an image). A `positions` hook
makes each sample's positions instead of `0 .. L-1`: `[A, L]` for A position axes (Qwen's multimodal RoPE: 3,
temporal, height, width), and the batch's `position_ids` are then `[A, B, S]`. Optionally
(`pack_sequences=True`, with energon's `packing_buffer_size`), several samples share one row of `seq_length`
tokens, the B rows are laid end to end as one `[1, B * S]` row (megatron-core's THD format takes batch 1), and
the batch carries `packing_kwargs` for MimoModel (THD cu_seqlens; positions restart per sample). With a
`segment_multiple` m > 1 (the LLM's context-parallel split: transformer-engine cuts each packed segment into
2 x CP chunks) each packed sample takes its length rounded up to m in the row, padded after its tokens (no loss,
its positions continued), and the THD sequences are those places (`cu_seqlens_q` = `cu_seqlens_q_padded`).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Sequence

import torch
from megatron.energon import DefaultTaskEncoder, Sample, edataclass, stateless

from .images import FixedTiles, ImageMode, to_float_image
from .skips import OVER_IMAGE_BUDGET, SkipRecord, TooLong
from .tokenizer import Tokenizer

__all__ = ["EncodedSample", "MultimodalTaskEncoder", "is_tombstone", "tombstone"]


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
    #: `[L]` position of each token within its own sample (`[A, L]` from a `positions` hook with A axes)
    position_ids: torch.Tensor
    #: the sample's images, in placeholder order
    images: list
    #: lengths of the samples packed in this row (one entry when not packed; none in a tombstone)
    seqlens: list
    #: how many of `images` each packed sample has, in `seqlens` order (what the loader's FLOPs count follows)
    image_counts: list = dataclasses.field(default_factory=list)
    #: the skipped samples this item carries (a tombstone's own; in a pack, those that came before its samples)
    dropped: list = dataclasses.field(default_factory=list)
    #: what seq_length cut: all tokens, trained (answer) tokens; and the trained tokens before the cut
    cut_tokens: int = 0
    cut_answer_tokens: int = 0
    answer_tokens: int = 0
    #: the longest sample's whole length (what seq_length would have to be)
    needed_tokens: int = 0


def tombstone(sample, record: SkipRecord) -> EncodedSample:
    """A skipped sample's place in the stream: no tokens, its record (counted when the loader consumes it)."""
    empty = torch.zeros(0, dtype=torch.long)
    fields = dict(tokens=empty, labels=empty, loss_mask=torch.zeros(0), position_ids=empty, images=[], seqlens=[],
                  dropped=[record])
    if isinstance(sample, Sample):
        return EncodedSample.derive_from(sample, **fields)
    get = sample.get if isinstance(sample, dict) else (lambda name, default=None: getattr(sample, name, default))
    return EncodedSample(__key__=str(get("__key__", "") or ""), __restore_key__=get("__restore_key__", ()) or (),
                         __sources__=get("__sources__", None), **fields)


def continued(position_ids: torch.Tensor, extra: int) -> torch.Tensor:
    """`extra` positions after `position_ids` ([L] or [A, L]), on every axis from its largest last value + 1 (0
    after none): what padding after a sample takes."""
    last = int(position_ids[..., -1].max()) + 1 if position_ids.numel() else 0
    return torch.arange(last, last + extra, dtype=torch.long).expand(*position_ids.shape[:-1], extra)


def is_tombstone(sample) -> bool:
    return not sample.seqlens and bool(getattr(sample, "dropped", None))


class MultimodalTaskEncoder(DefaultTaskEncoder):
    """Turns CaptioningSamples (or any sample with an `image`/`images` and a `caption`/`text`) into micro-batches.

    Args:
        tokenizer: `encode`, `pad_id`, `eos_id`, `image_token_id` (see `tokenizer.py`).
        seq_length: token budget of a sample (and the padded row length of a batch).
        image_mode: `FixedTiles(...)` or `DynamicResolution(...)`.
        encoder_name / modality: where the encoder input goes: `modality_inputs[modality][encoder_name]`.
        min_text_tokens: a sample whose image tokens leave fewer text tokens than this is skipped.
        pad_to_longest: pad a batch to its longest row (rounded up to `pad_multiple`) instead of `seq_length`.
        pack_sequences: pack several samples into one row (needs `packing_buffer_size` in energon's
            `get_train_dataset`); the batch then carries `packing_kwargs` (THD) for the language model.
        segment_multiple: packed samples' padded lengths are a multiple of this (`DataContext.segment_multiple`:
            the LLM's context-parallel split); `seq_length` must be one too.
        image_token_budget: with packing, the image placeholders one row may carry (None: no bound but the row's);
            the loop sets it from the memory plan (`DataContext.pack_image_tokens`), and a sample whose own images
            take more is skipped as too long.
        positions: a sample's positions from its tokens `[L]` and processed images: `[L]` or `[A, L]` (A axes, e.g.
            a multimodal RoPE's temporal, height and width); None: `0 .. L-1`. Called per sample, so packed rows
            restart them per sample; padding continues a row's last sample from its largest last position.
    """

    def __init__(self, tokenizer: Tokenizer, *, seq_length: int, image_mode: ImageMode | None = None,
                 encoder_name: str = "vit", modality: str = "images",
                 min_text_tokens: int = 1,
                 pad_to_longest: bool = False, pad_multiple: int = 1, pack_sequences: bool = False,
                 segment_multiple: int = 1, image_token_budget: int | None = None, positions=None):
        super().__init__()
        if seq_length < 2:
            raise ValueError(f"seq_length must be >= 2, got {seq_length}")
        if segment_multiple < 1:
            raise ValueError(f"segment_multiple must be >= 1, got {segment_multiple}")
        if pack_sequences and seq_length % segment_multiple:
            raise ValueError(f"seq_length {seq_length} must be a multiple of segment_multiple {segment_multiple} "
                             f"(the row's last packed segment ends the row)")
        if min_text_tokens < 1:
            raise ValueError("min_text_tokens must be >= 1: a sample needs a token to learn")
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.image_mode = image_mode if image_mode is not None else FixedTiles()
        self.encoder_name = encoder_name
        self.modality = modality
        self.min_text_tokens = min_text_tokens
        self.pad_to_longest = pad_to_longest
        self.pad_multiple = max(1, pad_multiple)
        self.pack_sequences = pack_sequences
        self.segment_multiple = segment_multiple
        self.image_token_budget = image_token_budget
        self.positions = positions

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

    def _skip(self, needed: int, message: str):
        """Too long: the loader's copy of the encoder turns this into a tombstone (`deferred_errors.py`)."""
        raise TooLong(f"needs {needed} tokens, {message} within seq_length {self.seq_length}: raise seq_length",
                      needed)

    def _check_image_budget(self, image_tokens: int, needed: int) -> None:
        """A packed row carries at most `image_token_budget` image tokens: a sample whose own images take more is
        skipped as too long (the memory plan sized the encoders for the budget)."""
        if self.pack_sequences and self.image_token_budget is not None and image_tokens > self.image_token_budget:
            raise TooLong(f"its images take {image_tokens} image tokens, more than a packed row's "
                          f"{self.image_token_budget} (--pack-image-tokens): raise it if the memory plan allows, or "
                          f"lower the provider's largest image size", needed, reason=OVER_IMAGE_BUDGET)

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
        text = self._text_of(sample)
        whole = sum(counts) + len(self.tokenizer.encode(text)) + 1  # + eos
        if sum(counts) + self.min_text_tokens > self.seq_length:
            self._skip(whole, f"its {sum(counts)} image tokens leave fewer than {self.min_text_tokens} for text")
        self._check_image_budget(sum(counts), whole)
        processed = [self.image_mode.process(im) for im in images]
        assert [p.num_tokens for p in processed] == counts
        tokens, labels, loss_mask = self.encode_tokens(text, counts)
        out = self._encoded(sample, tokens, labels, loss_mask, processed)
        trained_whole = whole - sum(counts) - (0 if counts else 1)  # the first text token is a target after an image
        return self._with_cut(out, whole, trained_whole)

    @staticmethod
    def _with_cut(out: EncodedSample, whole: int, trained_whole: int) -> EncodedSample:
        """`out` with what the cut to seq_length took: of `whole` tokens, `trained_whole` of them trained."""
        out.cut_tokens = whole - len(out.tokens)
        out.answer_tokens = trained_whole
        out.cut_answer_tokens = trained_whole - int(out.loss_mask.sum())
        out.needed_tokens = whole
        return out

    def _encoded(self, sample, tokens, labels, loss_mask, images: list) -> EncodedSample:
        """One sample's row, keeping the sample's key and restore key (an energon Sample or a raw dict)."""
        positions = torch.arange(len(tokens), dtype=torch.long) if self.positions is None else \
            self.positions(tokens, images).long()
        fields = dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=positions, images=images,
                      seqlens=[len(tokens)], image_counts=[len(images)])
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
        # A tombstone rides with the next sample of the stream (the buffer comes in stream order), so it counts
        # when that sample's pack is consumed; those after the last sample make a pack of their own.
        good, riders, waiting = [], {}, []
        for s in samples:
            if is_tombstone(s):
                waiting.append(s)
            else:
                good.append(s)
                riders[id(s)], waiting = waiting, []
        groups = [[r for s in group for r in (*riders[id(s)], s)] for group in self._first_fit(good)]
        return groups + ([waiting] if waiting else [])

    def _padded(self, length: int) -> int:
        """A packed sample's place in its row: its length rounded up to the segment multiple."""
        return -(-length // self.segment_multiple) * self.segment_multiple

    def _first_fit(self, samples: list[EncodedSample]) -> list[list[EncodedSample]]:
        """Rows bounded by two budgets: `seq_length` tokens and `image_token_budget` image tokens (the encoders'
        share of the row, which the memory plan counts)."""
        budget = self.image_token_budget if self.image_token_budget is not None else math.inf
        bins: list[tuple[int, int, list[EncodedSample]]] = []
        for s in sorted(samples, key=lambda s: -len(s.tokens)):
            # padded places: seq_length is a multiple of them, so the last sample's padding fits the row's tail
            n, images = self._padded(len(s.tokens)), sum(im.num_tokens for im in s.images)
            for i, (used, used_images, group) in enumerate(bins):
                if used + n <= self.seq_length and used_images + images <= budget:
                    bins[i] = (used + n, used_images + images, group + [s])
                    break
            else:
                bins.append((n, images, [s]))
        # a fixed order (resumes re-make it) from the samples' keys
        return sorted((group for _, _, group in bins),
                      key=lambda group: zlib.crc32(",".join(str(s.__key__) for s in group).encode()))

    @stateless
    def pack_selected_samples(self, samples: list[EncodedSample]) -> EncodedSample:
        if len(samples) == 1:
            return samples[0]
        dropped = [record for s in samples for record in s.dropped]
        counts = dict(dropped=dropped, cut_tokens=sum(s.cut_tokens for s in samples),
                      cut_answer_tokens=sum(s.cut_answer_tokens for s in samples),
                      answer_tokens=sum(s.answer_tokens for s in samples),
                      needed_tokens=max(s.needed_tokens for s in samples))
        good = [s for s in samples if not is_tombstone(s)]
        if len(good) <= 1:  # one sample and the skipped ones before it (or skipped ones alone)
            return dataclasses.replace(good[0] if good else samples[0], **counts)
        # each sample but the last padded to its place (the row's tail pads the last one, in `batch`)
        rows = [self._padded_tail(s) for s in good[:-1]] + [(s.tokens, s.labels, s.loss_mask, s.position_ids)
                                                              for s in good[-1:]]
        tokens, labels, loss_mask, position_ids = (torch.cat(parts, dim=-1) for parts in zip(*rows))
        return EncodedSample(
            __key__=",".join(s.__key__ for s in good),
            __restore_key__=(),
            __sources__=tuple(src for s in good for src in (s.__sources__ or ())),
            tokens=tokens,
            labels=labels,  # a sample's last label is already masked
            loss_mask=loss_mask,
            position_ids=position_ids,
            images=[im for s in good for im in s.images],
            seqlens=[n for s in good for n in s.seqlens],
            image_counts=[n for s in good for n in s.image_counts],
            **counts,
        )

    def _padded_tail(self, sample: EncodedSample) -> tuple[torch.Tensor, ...]:
        """(tokens, labels, loss_mask, position_ids) of `sample` padded to its place: pad ids, no loss, the
        sample's positions continued (the padding is its segment's tail in `cu_seqlens_q_padded`)."""
        n = len(sample.tokens)
        extra = self._padded(n) - n
        if not extra:
            return sample.tokens, sample.labels, sample.loss_mask, sample.position_ids
        pad = torch.full((extra,), self.tokenizer.pad_id, dtype=sample.tokens.dtype)
        return (torch.cat([sample.tokens, pad]), torch.cat([sample.labels, pad.to(sample.labels.dtype)]),
                torch.cat([sample.loss_mask, sample.loss_mask.new_zeros(extra)]),
                torch.cat([sample.position_ids, continued(sample.position_ids, extra)], dim=-1))

    # -- batching -----------------------------------------------------------------------------------------------

    def _row_length(self, samples: list[EncodedSample]) -> int:
        if not self.pad_to_longest:
            return self.seq_length
        longest = max(len(s.tokens) for s in samples)
        # packed: a multiple of the segments' too, so that the row's tail keeps the last segment one
        multiple = math.lcm(self.pad_multiple, self.segment_multiple) if self.pack_sequences else self.pad_multiple
        return min(self.seq_length, -(-longest // multiple) * multiple)

    @stateless
    def batch(self, samples: list[EncodedSample]) -> dict:
        tok = self.tokenizer
        b, s = len(samples), self._row_length(samples)
        input_ids = torch.full((b, s), tok.pad_id, dtype=torch.long)
        labels = torch.full((b, s), tok.pad_id, dtype=torch.long)
        loss_mask = torch.zeros((b, s), dtype=torch.float32)
        # position axes: [B, S], or [A, B, S] where a positions hook gives A of them
        axes = next((x.position_ids.shape[:-1] for x in samples if x.position_ids.numel()), ())
        position_ids = torch.arange(s, dtype=torch.long).repeat(*axes, b, 1)
        for i, sample in enumerate(samples):
            n = len(sample.tokens)
            if n > s:
                raise ValueError(f"sample {sample.__key__} has {n} tokens, more than the row length {s}")
            input_ids[i, :n] = sample.tokens
            labels[i, :n] = sample.labels
            loss_mask[i, :n] = sample.loss_mask
            if self.pack_sequences or self.positions is not None:
                position_ids[..., i, :n] = sample.position_ids
                # padding continues the row's last sequence (it is that sequence's padded tail in packing_kwargs)
                position_ids[..., i, n:] = continued(sample.position_ids, s - n)
        out = {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
               "modality_inputs": {}}
        images = [im for sample in samples for im in sample.images]
        if images:
            out["modality_inputs"] = {self.modality: {self.encoder_name: self.image_mode.collate(images)}}
        if self.pack_sequences:
            # megatron-core's THD path takes the packed batch as one row (batch 1), sequences laid end to end
            for key in ("input_ids", "labels", "loss_mask", "position_ids"):
                out[key] = out[key].reshape(*out[key].shape[:-2], 1, b * s)
            out["packing_kwargs"] = self._packing_kwargs(samples, s)
        return out

    def _packing_kwargs(self, samples: list[EncodedSample], row: int) -> dict:
        """THD cu_seqlens over the batch flattened to `[B * row]`: a sample's padded boundaries are its place
        (`_padded`), and each row's padding joins its last sequence (an empty row is one padded sequence of length
        0). `total_tokens` lets megatron-core derive each token's sequence index (`seq_idx`, which mamba-ssm's
        kernels read).

        With a segment multiple above 1 (the LLM's CP split) the sequences are their places, padding included:
        transformer-engine's attention then splits real and padded boundaries alike (its split of a sequence
        whose real length is not a multiple of 2 x CP differs from the rows' split), and the padding, after its
        sample's tokens, reaches none of them under causal attention and the causal scan.

        The sequence-level MoE auxiliary loss is each sample's: a layer of `mimo.plugins.kit.packed_seq_aux_loss`
        (Nemotron's) reads each token's sample from these boundaries, its first `cu_seqlens_q` length real and the
        rest of its place padding (under CP the places are the sequences: their padding counts as the sample's).
        `tokens_per_sample` (the row length) is megatron-core's own way, for MoE layers without it: they see the
        flattened batch as its rows again and balance each row, not the whole micro-batch (the loop adapts it to a
        context-parallel rank's share: core/parallel/context_parallel.py)."""
        lengths, padded = [], []
        for sample in samples:
            seqlens = list(sample.seqlens) or [0]
            lengths += seqlens
            places = [self._padded(n) for n in seqlens[:-1]]
            padded += places + [row - sum(places)]
        cu_p = torch.zeros(len(padded) + 1, dtype=torch.int32)
        cu_p[1:] = torch.tensor(padded, dtype=torch.int64).cumsum(0).to(torch.int32)
        if self.segment_multiple > 1:
            cu = cu_p.clone()
        else:
            cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
            cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
        return {
            "cu_seqlens_q": cu, "cu_seqlens_kv": cu.clone(), "cu_seqlens_q_padded": cu_p,
            "cu_seqlens_kv_padded": cu_p.clone(),
            "max_seqlen_q": torch.tensor(max(padded), dtype=torch.int32),
            "max_seqlen_kv": torch.tensor(max(padded), dtype=torch.int32),
            "total_tokens": len(samples) * row,
            "tokens_per_sample": row,
        }

