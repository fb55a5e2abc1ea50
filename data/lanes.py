"""Merging the encoder inputs of several data lanes (e.g. the LLM's data-parallel lanes that feed one encoder rank).

What to do with a key is fixed by a schema, never guessed from shapes: fixed-tile inputs `{"x": [N, 3, H, W]}`
concatenate `x` on dim 0; dynamic-resolution inputs `{"x": [1, P, D], "imgs_sizes": [N, 2], "packed_seq_params":
PackedSeqParams}` concatenate `x` on dim 1 (one packed buffer), `imgs_sizes` on dim 0, and join the packed sequence
parameters by shifting each later lane's cumulative sequence lengths by the previous lanes' totals. A lane's input is
dynamic-resolution when it has `imgs_sizes` or `packed_seq_params`, otherwise fixed tiles, so two lanes whose
buffers happen to have the same shape still merge on the right dimension. A key outside the schema raises
`TypeError` naming it.

Whole micro-batches of several lanes merge the same way (`merge_lane_batches`): the `[b, s]` token tensors stack
in lane order (an encoder rank's MimoModel reads each row's placeholders to split its output per sample),
`modality_inputs` merge as above, and `packing_kwargs` join like packed sequence parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

import torch
from megatron.core.packed_seq_params import PackedSeqParams

__all__ = [
    "DYNAMIC_RESOLUTION_SCHEMA", "FIXED_TILES_SCHEMA", "ROW_KEYS", "merge_encoder_inputs", "merge_lane_batches",
    "merge_modality_inputs", "merge_packed_seq_params", "schema_of",
]

CAT_DIM0 = "cat_dim0"
CAT_DIM1 = "cat_dim1"
PACKED = "packed_seq_params"

FIXED_TILES_SCHEMA: Mapping[str, str] = {"x": CAT_DIM0}
DYNAMIC_RESOLUTION_SCHEMA: Mapping[str, str] = {"x": CAT_DIM1, "imgs_sizes": CAT_DIM0, "packed_seq_params": PACKED}
_DYNAMIC_MARKERS = ("imgs_sizes", "packed_seq_params")

_CU_FIELDS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
_MAX_FIELDS = ("max_seqlen_q", "max_seqlen_kv")
# Fields that describe the whole pack rather than a lane: lanes must agree on them.
_SHARED_FIELDS = ("qkv_format", "local_cp_size", "cp_group", "pad_between_seqs", "tokens_per_sample")


def schema_of(encoder_input: Mapping[str, Any]) -> Mapping[str, str]:
    """The schema a lane's input follows, from its keys (not its shapes)."""
    if any(k in encoder_input for k in _DYNAMIC_MARKERS):
        return DYNAMIC_RESOLUTION_SCHEMA
    return FIXED_TILES_SCHEMA


def _as_int(value) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def merge_packed_seq_params(params: Iterable[PackedSeqParams]) -> PackedSeqParams:
    """One PackedSeqParams for the lanes' packs laid end to end.

    Each `cu_seqlens*` field of a later lane is shifted by the sum of the previous lanes' totals of that field (its
    last entry) and appended without its leading 0; `max_seqlen*` is the max over the lanes; `total_tokens` is summed
    when every lane has one. Lanes must agree on the other fields (`qkv_format`, ...).
    """
    params = list(params)
    if not params:
        raise ValueError("no PackedSeqParams to merge")
    for p in params:
        if not isinstance(p, PackedSeqParams):
            raise TypeError(f"packed_seq_params must be a PackedSeqParams, got {type(p).__name__}")
    kwargs: dict[str, Any] = {}
    for name in _SHARED_FIELDS:
        values = [getattr(p, name) for p in params]
        if any(v is not values[0] and v != values[0] for v in values[1:]):
            raise ValueError(f"lanes disagree on PackedSeqParams.{name}: {values}")
        kwargs[name] = values[0]
    for name in _CU_FIELDS:
        values = [getattr(p, name) for p in params]
        if all(v is None for v in values):
            continue
        if any(v is None for v in values):
            raise ValueError(f"PackedSeqParams.{name} is set in some lanes but not in others")
        pieces, offset = [values[0].to(torch.int32)], 0
        for prev, cur in zip(values[:-1], values[1:]):
            offset += _as_int(prev[-1])
            if _as_int(cur[0]) != 0:
                raise ValueError(f"PackedSeqParams.{name} of a lane does not start at 0: {cur.tolist()}")
            pieces.append(cur[1:].to(torch.int32) + offset)
        kwargs[name] = torch.cat(pieces)
    for name in _MAX_FIELDS:
        values = [getattr(p, name) for p in params]
        if all(v is None for v in values):
            continue
        known = [_as_int(v) for v in values if v is not None]
        first = values[0]
        kwargs[name] = torch.tensor(max(known), dtype=first.dtype) if isinstance(first, torch.Tensor) else max(known)
    totals = [p.total_tokens for p in params]
    if all(t is not None for t in totals):
        kwargs["total_tokens"] = sum(_as_int(t) for t in totals)
    known_fields = {f.name for f in dataclasses.fields(PackedSeqParams)}
    return PackedSeqParams(**{k: v for k, v in kwargs.items() if k in known_fields})


def merge_encoder_inputs(inputs: Iterable[Mapping[str, Any] | None],
                         schema: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Merge one encoder's inputs from several lanes, in lane order.

    Empty lanes (`None` or `{}`) are skipped; with no non-empty lane the result is `{}`. `schema` maps each key to
    `"cat_dim0"`, `"cat_dim1"` or `"packed_seq_params"`; by default it comes from the lanes' keys (see
    `schema_of`), and all lanes must follow the same one.
    """
    lanes = [dict(lane) for lane in inputs if lane]
    if not lanes:
        return {}
    if schema is None:
        schemas = {id(schema_of(lane)): schema_of(lane) for lane in lanes}
        if len(schemas) > 1:
            raise ValueError("lanes mix fixed-tile and dynamic-resolution encoder inputs: "
                             f"{[sorted(lane) for lane in lanes]}")
        schema = next(iter(schemas.values()))
    for lane in lanes:
        for key in lane:
            if key not in schema:
                raise TypeError(f"merge_encoder_inputs: no merge rule for key {key!r} "
                                f"(known keys: {sorted(schema)})")
    keys = [k for k in schema if any(k in lane for lane in lanes)]
    merged: dict[str, Any] = {}
    for key in keys:
        missing = [i for i, lane in enumerate(lanes) if key not in lane]
        if missing:
            raise ValueError(f"key {key!r} is missing from lanes {missing}")
        values = [lane[key] for lane in lanes]
        rule = schema[key]
        if rule in (CAT_DIM0, CAT_DIM1):
            dim = 0 if rule == CAT_DIM0 else 1
            for v in values:
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"key {key!r}: expected a tensor, got {type(v).__name__}")
                if v.ndim <= dim:
                    raise ValueError(f"key {key!r}: cannot concatenate a {v.ndim}-d tensor on dim {dim}")
            merged[key] = torch.cat(values, dim=dim)
        elif rule == PACKED:
            merged[key] = merge_packed_seq_params(values)
        else:
            raise ValueError(f"unknown merge rule {rule!r} for key {key!r}")
    if PACKED in merged and "x" in merged and schema.get("x") == CAT_DIM1:
        total = _as_int(merged[PACKED].cu_seqlens_q[-1])
        if total != merged["x"].shape[1]:
            raise ValueError(f"merged packed_seq_params cover {total} tokens but x has {merged['x'].shape[1]}")
    return merged


def merge_modality_inputs(inputs: Iterable[Mapping[str, Mapping[str, Mapping[str, Any]]] | None]) -> dict:
    """Merge whole `modality_inputs` dicts (`{modality: {encoder: input}}`) of several lanes, encoder by encoder."""
    lanes = [lane for lane in inputs if lane]
    out: dict[str, dict[str, Any]] = {}
    for modality in dict.fromkeys(m for lane in lanes for m in lane):
        encoders = dict.fromkeys(e for lane in lanes for e in (lane.get(modality) or {}))
        merged = {e: merge_encoder_inputs([(lane.get(modality) or {}).get(e) for lane in lanes]) for e in encoders}
        merged = {e: v for e, v in merged.items() if v}
        if merged:
            out[modality] = merged
    return out


# A micro-batch's per-row tensors `[b, s]` (position_ids may have axes in front: `[A, b, s]`), stacked on the rows'
# dimension when lanes merge.
ROW_KEYS = ("input_ids", "labels", "loss_mask", "position_ids", "attention_mask")


def merge_lane_batches(batches: Iterable[Mapping[str, Any]]) -> dict:
    """One micro-batch from several lanes' micro-batches, rows in lane order.

    Rows of different widths (lanes padded to their own longest row) are right-padded with zeros (no loss, no
    placeholder) to the widest, except under `packing_kwargs`, whose offsets count every row at full width.
    """
    batches = [dict(b) for b in batches]
    if not batches:
        raise ValueError("no micro-batches to merge")
    for b in batches:
        unknown = sorted(set(b) - set(ROW_KEYS) - {"modality_inputs", "packing_kwargs"})
        if unknown:
            raise TypeError(f"merge_lane_batches: no merge rule for key {unknown[0]!r} (known keys: "
                            f"{sorted(ROW_KEYS) + ['modality_inputs', 'packing_kwargs']})")
    width = max(b["input_ids"].shape[1] for b in batches)
    merged: dict[str, Any] = {}
    for key in ROW_KEYS:
        present = [key in b for b in batches]
        if not any(present):
            continue
        if not all(present):
            raise ValueError(f"key {key!r} is missing from lanes {[i for i, p in enumerate(present) if not p]}")
        rows = [b[key] for b in batches]
        rows = [torch.nn.functional.pad(r, (0, width - r.shape[-1])) if r.shape[-1] < width else r for r in rows]
        merged[key] = torch.cat(rows, dim=-2)
    merged["modality_inputs"] = merge_modality_inputs(b.get("modality_inputs") for b in batches)
    packing = [b.get("packing_kwargs") for b in batches]
    if any(p is not None for p in packing):
        if any(p is None for p in packing) or any(b["input_ids"].shape[1] != width for b in batches):
            raise ValueError("packed lanes merge only when every lane is packed into rows of the same width")
        joined = merge_packed_seq_params(PackedSeqParams(**p) for p in packing)
        merged["packing_kwargs"] = {k: getattr(joined, k) for k in packing[0]}
    return merged
