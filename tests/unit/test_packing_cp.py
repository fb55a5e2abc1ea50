"""Sequence packing for the LLM's context parallelism: each packed sample padded to a multiple of 2 x CP.

transformer-engine splits a packed (THD) row over the CP ranks per segment of `cu_seqlens_q_padded`
(`thd_get_partitioned_indices`: each segment cut into 2 x CP equal chunks, CP rank r keeping chunks r and
2 x CP - 1 - r), so every segment's padded length must be a multiple of 2 x CP. The task encoder's
`segment_multiple` lays the row out so; with 1 (no CP) the layout is today's, unchanged. The padding after each
sample trains nothing and reaches no sample: on the CPU's local backend each sample's loss is its unpacked one
(transformer-engine's split itself: scripts/gpu/context_parallel.sh).
"""

from __future__ import annotations

import importlib.util
import zlib

import pytest
import torch
from megatron.energon import CaptioningSample, TextSample

from helpers import build_mimo_model
from mimo.data import ByteTokenizer, FixedTiles, MultimodalTaskEncoder, merge_lane_batches
from mimo.plugins.data import ConversationTaskEncoder
from test_packing import mock_vlm, nemotron_tiny, token_losses, world  # noqa: F401 (world: the fixture)
from test_packing import samples as packing_samples
from mimo.data.skips import SkipRecord
from mimo.data.task_encoder import tombstone

SEQ = 64
TEXTS = ["hi", "a short caption", "seven", "a much longer caption that takes most of a row by itself",
         "x", "the ninth one", "twelve chars", "a", "some more words to pack", "ok", "tail end"]


def samples() -> list:
    out = []
    for i, text in enumerate(TEXTS):
        base = dict(__key__=f"s{i}", __restore_key__=())
        out.append(CaptioningSample(**base, image=torch.rand(3, 16, 16), caption=text) if i % 3 == 0
                   else TextSample(**base, text=text))
    return out


def encoder(multiple: int = 1, **kwargs) -> MultimodalTaskEncoder:
    return MultimodalTaskEncoder(ByteTokenizer(), seq_length=SEQ, image_mode=FixedTiles(image_size=16, patch_size=8),
                                 pack_sequences=True, segment_multiple=multiple, **kwargs)


def packed_batch(te: MultimodalTaskEncoder, encoded: list):
    groups = te.select_samples_to_pack(encoded)
    return groups, te.batch([te.pack_selected_samples(g) for g in groups])


def encoded_samples(te: MultimodalTaskEncoder) -> list:
    encoded = [te.encode_sample(s) for s in samples()]
    skipped = tombstone(samples()[0], SkipRecord(key="gone", reason="too_long", error=""))
    return encoded[:3] + [skipped] + encoded[3:]  # a skipped sample rides with the next one


def test_packed_samples_take_places_of_a_multiple_of_the_cp_split():
    te = encoder(4)
    encoded = encoded_samples(te)
    lengths = {s.__key__: len(s.tokens) for s in encoded if s.seqlens}
    assert any(n % 4 for n in lengths.values()), "the test needs lengths that are not multiples of 4"
    groups, batch = packed_batch(te, encoded)
    good = [[s for s in g if s.seqlens] for g in groups]
    assert max(len(g) for g in good) > 1
    for g in good:  # a pack never exceeds its row, counting each sample's padded place
        assert sum(-(-len(s.tokens) // 4) * 4 for s in g) <= SEQ

    pk = batch["packing_kwargs"]
    cu, cu_p = pk["cu_seqlens_q"].tolist(), pk["cu_seqlens_q_padded"].tolist()
    places = [b - a for a, b in zip(cu_p[:-1], cu_p[1:])]
    assert all(p % 4 == 0 for p in places)  # the row's last place is its tail: a multiple too, as SEQ is
    ordered = [s for g in good for s in g]
    assert cu == cu_p  # the sequences are their places: transformer-engine splits them as the rows are split
    assert cu_p[-1] == pk["total_tokens"] == len(groups) * SEQ == batch["input_ids"].shape[1]
    assert int(pk["max_seqlen_q"]) == max(places)

    ends_a_row = {id(g[-1]) for g in good}
    assert any(p > len(s.tokens) for s, p in zip(ordered, places) if id(s) not in ends_a_row)  # padding between
    ids, labels, mask, pos = (batch[k][0] for k in ("input_ids", "labels", "loss_mask", "position_ids"))
    for s, start, place in zip(ordered, cu_p[:-1], places):
        n = len(s.tokens)
        assert torch.equal(ids[start:start + n], s.tokens) and torch.equal(labels[start:start + n], s.labels)
        assert torch.equal(mask[start:start + n], s.loss_mask)
        assert (ids[start + n:start + place] == te.tokenizer.pad_id).all()
        assert (labels[start + n:start + place] == te.tokenizer.pad_id).all()
        assert float(mask[start + n:start + place].sum()) == 0.0  # padding learns nothing
        assert torch.equal(pos[start:start + place], torch.arange(place))  # its sample's positions, continued
    # no sample lost, nor any of its trained tokens or images
    assert sorted(s.__key__ for s in ordered) == sorted(lengths)
    assert float(mask.sum()) == sum(float(s.loss_mask.sum()) for s in ordered)
    placeholders = int((ids == te.tokenizer.image_token_id).sum())
    assert placeholders == 4 * batch["modality_inputs"]["images"]["vit"]["x"].shape[0] > 0


@pytest.mark.parametrize("provider", [mock_vlm, nemotron_tiny], ids=["mock-vlm", "nemotron-moe-vlm-tiny"])
def test_padded_packs_train_each_sample_as_if_alone(world, provider):
    """The padding after a packed sample learns nothing and reaches no sample (it comes after the sample's tokens,
    under causal attention and the causal scan): each sample's summed loss is its unpacked one (local backend,
    fp32)."""
    module, settings, modality, encoder_args = provider()
    model = build_mimo_model(module, settings, modality)
    unpacked = ConversationTaskEncoder(**encoder_args)
    padded = ConversationTaskEncoder(**encoder_args, pack_sequences=True, segment_multiple=8)
    encoded = [unpacked.encode_sample(s) for s in packing_samples()]
    losses = token_losses(model, unpacked.batch(encoded)).reshape(len(encoded), settings.seq_length)
    alone = {s.__key__: losses[i, :len(s.tokens)].sum().item() for i, s in enumerate(encoded)}

    groups = padded.select_samples_to_pack(encoded)
    batch = padded.batch([padded.pack_selected_samples(g) for g in groups])
    cu_p = batch["packing_kwargs"]["cu_seqlens_q_padded"].tolist()
    ordered, ends_a_row = [s for g in groups for s in g], {id(g[-1]) for g in groups}
    assert any(b - a > len(s.tokens) for a, b, s in zip(cu_p[:-1], cu_p[1:], ordered) if id(s) not in ends_a_row)
    flat = token_losses(model, batch)
    together = {s.__key__: flat[start:start + len(s.tokens)].sum().item() for s, start in zip(ordered, cu_p[:-1])}
    assert together.keys() == alone.keys()
    for key, loss in alone.items():
        assert loss > 0 and together[key] == pytest.approx(loss, rel=1e-5, abs=1e-6), key


def _first_fit_today(samples: list, row: int) -> list:
    """The packing's grouping before segment multiples: first-fit decreasing on the samples' lengths."""
    bins = []
    for s in sorted(samples, key=lambda s: -len(s.tokens)):
        for b in bins:
            if sum(len(x.tokens) for x in b) + len(s.tokens) <= row:
                b.append(s)
                break
        else:
            bins.append([s])
    return sorted(bins, key=lambda b: zlib.crc32(",".join(str(s.__key__) for s in b).encode()))


def test_a_multiple_of_one_packs_as_before():
    te = encoder(1)
    encoded = [te.encode_sample(s) for s in samples()]
    groups, batch = packed_batch(te, encoded)
    assert [[s.__key__ for s in g] for g in groups] == [[s.__key__ for s in g]
                                                        for g in _first_fit_today(encoded, SEQ)]
    # today's layout: the samples end to end, each row's padding after its last sample
    pad = te.tokenizer.pad_id
    for r, g in enumerate(groups):
        row = slice(r * SEQ, (r + 1) * SEQ)
        used = sum(len(s.tokens) for s in g)
        expected = torch.cat([s.tokens for s in g] + [torch.full((SEQ - used,), pad)])
        assert torch.equal(batch["input_ids"][0, row], expected)
        last = torch.arange(len(g[-1].tokens), len(g[-1].tokens) + SEQ - used)
        assert torch.equal(batch["position_ids"][0, row], torch.cat([s.position_ids for s in g] + [last]))
    lengths = [len(s.tokens) for g in groups for s in g]
    padded = [n for g in groups for n in [len(s.tokens) for s in g[:-1]] + [len(g[-1].tokens) + SEQ - sum(
        len(s.tokens) for s in g)]]
    pk = batch["packing_kwargs"]
    assert pk["cu_seqlens_q"].tolist() == [0] + torch.tensor(lengths).cumsum(0).tolist()
    assert pk["cu_seqlens_q_padded"].tolist() == [0] + torch.tensor(padded).cumsum(0).tolist()
    assert pk["cu_seqlens_q"].dtype == pk["cu_seqlens_q_padded"].dtype == torch.int32


def test_a_row_that_no_multiple_divides_is_refused():
    with pytest.raises(ValueError, match="seq_length 64 must be a multiple of segment_multiple 24"):
        encoder(24)


def test_rows_padded_to_the_longest_stay_a_multiple_of_the_segments():
    te = encoder(8, pad_to_longest=True, pad_multiple=3)
    short = [te.encode_sample(TextSample(__key__=k, __restore_key__=(), text=t)) for k, t in (("a", "ab"),
                                                                                              ("b", "abcdefghi"))]
    _, batch = packed_batch(te, short)
    places = batch["packing_kwargs"]["cu_seqlens_q_padded"].diff().tolist()
    assert batch["input_ids"].shape[1] % 24 == 0 and all(p % 8 == 0 for p in places)


def test_lanes_merge_with_the_padded_offsets_shifted_by_padded_totals():
    te = encoder(4)
    encoded = [te.encode_sample(s) for s in samples()]
    (_, a), (_, b) = packed_batch(te, encoded[:5]), packed_batch(te, encoded[5:])
    merged = merge_lane_batches([a, b])["packing_kwargs"]
    pa, pb = a["packing_kwargs"], b["packing_kwargs"]
    for name in ("cu_seqlens_q", "cu_seqlens_q_padded"):
        assert merged[name].tolist() == pa[name].tolist() + (pb[name][1:] + int(pa[name][-1])).tolist()
    assert all(p % 4 == 0 for p in merged["cu_seqlens_q_padded"].diff().tolist())
    assert merged["total_tokens"] == pa["total_tokens"] + pb["total_tokens"]


def thd_partitioned_indices(cu_padded: torch.Tensor, total: int, cp: int, rank: int) -> torch.Tensor:
    """transformer-engine's documented split of a THD row over CP (`thd_get_partitioned_indices`): each segment of
    `cu_padded` cut into 2 x CP equal chunks, CP rank `rank` keeping chunks rank and 2 x CP - 1 - rank."""
    kept = []
    bounds = cu_padded.tolist()
    assert bounds[-1] == total
    for start, end in zip(bounds[:-1], bounds[1:]):
        assert (end - start) % (2 * cp) == 0, f"segment [{start}, {end}) does not split into {2 * cp} chunks"
        chunk = (end - start) // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            kept.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(kept)


@pytest.mark.parametrize("cp, tp", [(2, 1), (4, 1), (2, 2)])
def test_the_padded_layout_is_what_transformer_engines_split_expects(cp, tp):
    """2 x CP (x TP under sequence parallelism, which then scatters each CP rank's part over TP): every segment
    splits evenly, the ranks' parts cover the row once, and each part divides over TP."""
    te = encoder(2 * cp * tp)
    _, batch = packed_batch(te, [te.encode_sample(s) for s in samples()])
    cu_p, total = batch["packing_kwargs"]["cu_seqlens_q_padded"], batch["input_ids"].shape[1]
    parts = [thd_partitioned_indices(cu_p, total, cp, r) for r in range(cp)]
    assert all(len(p) == total // cp and len(p) % tp == 0 for p in parts)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(total))
    if importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available():
        import transformer_engine_torch as tex

        for r, part in enumerate(parts):
            got = tex.thd_get_partitioned_indices(cu_p.cuda(), total, cp, r)
            assert torch.equal(got.cpu().long().sort().values, part.sort().values)
