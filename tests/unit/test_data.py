"""mimo.data: the synthetic energon dataset, tokenizers, the multimodal task encoder, lane merging, skips."""

from __future__ import annotations

import json
import math
import re
import shutil
import sys

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.energon import CaptioningSample, TextSample, WorkerConfig, get_loader, get_train_dataset

from mimo.data import (
    ByteTokenizer, DynamicResolution, FixedTiles, HFTokenizer, MultimodalTaskEncoder, SkippedSampleCounter, Tokenizer,
    dynamic_num_tokens, fit_patch_grid, get_multimodal_train_loader, load_hf_tokenizer, merge_encoder_inputs,
    merge_modality_inputs, patchify, tile_num_tokens, write_sample_dataset,
)
from mimo.data.skips import TooLong
from mimo.errors import UsageError

CAPTION_RE = re.compile(r"^a (small|large) [a-z]+ [a-z]+ on a [a-z]+ background$")
NUM_SAMPLES = 24
PATCH = 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_sample_dataset(tmp_path_factory.mktemp("ds") / "captions", num_samples=NUM_SAMPLES, seed=3,
                                min_size=24, max_size=96, shard_size=8)


@pytest.fixture(scope="module")
def corrupt_dataset(tmp_path_factory):
    return write_sample_dataset(tmp_path_factory.mktemp("ds") / "corrupt", num_samples=12, seed=5, shard_size=6,
                                corrupt_indices=[7])


def _dataset(path, task_encoder, batch_size, counter=None, **kwargs):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0,
                      **({"global_error_handler": counter} if counter is not None else {}))
    ds = get_train_dataset(path, worker_config=wc, batch_size=batch_size, shuffle_buffer_size=None,
                           max_samples_per_sequence=None, task_encoder=task_encoder, repeat=False, **kwargs)
    return list(get_loader(ds))


def _text_of_row(tok, ids):
    return tok.decode([i for i in ids.tolist() if i < 256])


def _check_row_invariants(tok, batch, row):
    ids, labels, mask = batch["input_ids"][row], batch["labels"][row], batch["loss_mask"][row]
    is_img = ids == tok.image_token_id
    n_img = int(is_img.sum())
    # placeholders come first and are contiguous
    assert bool(is_img[:n_img].all()) and not bool(is_img[n_img:].any())
    # where the loss counts, the label is the next input token and never an image placeholder
    on = mask.bool()
    assert bool((labels[:-1][on[:-1]] == ids[1:][on[:-1]]).all())
    assert not bool((labels[on] == tok.image_token_id).any())
    # no loss on a position whose next token is a placeholder, nor on padding
    if n_img > 1:
        assert float(mask[: n_img - 1].sum()) == 0.0
    length = int((ids != tok.pad_id).sum())
    assert float(mask[length - 1:].sum()) == 0.0
    return n_img, length


# --------------------------------------------------------------------------------------------------------------
# dataset writing and energon preparation


def test_sample_dataset_is_prepared_like_energon_prepare(dataset, tmp_path):
    meta = dataset.path / ".nv-meta"
    for name in ("dataset.yaml", "split.yaml", ".info.json", "index.sqlite", "index.uuid"):
        assert (meta / name).is_file(), name
    info = json.loads((meta / ".info.json").read_text())
    assert sum(info["shard_counts"].values()) == NUM_SAMPLES
    assert len(dataset.shards) == 3 and all((dataset.path / f"{s}.idx").is_file() for s in dataset.shards)

    # The same shards prepared by energon's own CLI, non-interactively, give the same yaml files.
    from megatron.energon.tools.prepare import command

    copy = tmp_path / "cli"
    copy.mkdir()
    for shard in dataset.shards:
        shutil.copy(dataset.path / shard, copy / shard)
    command.main([str(copy), "--non-interactive", "--split-ratio", "1,0,0", "--sample-type", "CaptioningSample",
                  "--field-map", '{"image": "jpg", "caption": "txt"}', "--num-workers", "1", "--no-progress"],
                 standalone_mode=False)
    for name in ("dataset.yaml", "split.yaml"):
        assert (copy / ".nv-meta" / name).read_text() == (meta / name).read_text(), name
    cli_info = json.loads((copy / ".nv-meta" / ".info.json").read_text())
    assert cli_info["shard_counts"] == info["shard_counts"]


def test_sample_dataset_images_vary_and_captions_describe_them(dataset):
    sizes = {(m["width"], m["height"]) for m in dataset.samples.values()}
    aspects = {round(w / h, 1) for w, h in sizes}
    assert len(sizes) > NUM_SAMPLES // 2 and len(aspects) > 4
    assert all(24 <= w <= 96 and 24 <= h <= 96 for w, h in sizes)
    for m in dataset.samples.values():
        assert CAPTION_RE.match(m["caption"]) and m["color"] in m["caption"] and m["shape"] in m["caption"]


def test_sample_dataset_val_split_and_argument_checks(tmp_path):
    info = write_sample_dataset(tmp_path / "v", num_samples=12, shard_size=4, val_shards=1)
    assert info.splits == {"train": ["shard_0000.tar", "shard_0001.tar"], "val": ["shard_0002.tar"], "test": []}
    with pytest.raises(ValueError):
        write_sample_dataset(tmp_path / "w", num_samples=4, shard_size=4, val_shards=1)
    with pytest.raises(ValueError):
        write_sample_dataset(tmp_path / "x", num_samples=4, corrupt_indices=[4])


# --------------------------------------------------------------------------------------------------------------
# tokenizer


def test_byte_tokenizer_roundtrip_and_special_ids():
    tok = ByteTokenizer()
    text = "a large red circle on a white background — ünïcode"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == text
    specials = [tok.pad_id, tok.bos_id, tok.eos_id, tok.image_token_id]
    assert len(set(specials)) == 4 and all(256 <= i < tok.vocab_size for i in specials)
    assert tok.decode(ids + [tok.eos_id, tok.image_token_id]) == text
    assert ByteTokenizer(vocab_size=512).vocab_size == 512
    with pytest.raises(ValueError):
        ByteTokenizer(vocab_size=100)


class _FakeHF:
    """The few methods of a Hugging Face tokenizer that HFTokenizer uses (transformers is not a dependency)."""

    def __init__(self):
        self.vocab = {"<unk>": 0, "</s>": 1, "a": 2, "b": 3}
        self.unk_token_id, self.eos_token_id, self.bos_token_id, self.pad_token_id = 0, 1, None, None

    def convert_tokens_to_ids(self, token):
        return self.vocab.get(token, self.unk_token_id)

    def add_special_tokens(self, spec):
        for t in spec["additional_special_tokens"]:
            self.vocab.setdefault(t, len(self.vocab))

    def __len__(self):
        return len(self.vocab)

    def encode(self, text, add_special_tokens=True):
        return [self.vocab[c] for c in text]

    def decode(self, ids, skip_special_tokens=False):
        inv = {v: k for k, v in self.vocab.items()}
        return "".join(inv[i] for i in ids if not (skip_special_tokens and inv[i].startswith("<")))


def test_hf_tokenizer_wrapper_interface():
    tok = HFTokenizer(_FakeHF())
    assert isinstance(tok, Tokenizer) and isinstance(ByteTokenizer(), Tokenizer)
    assert tok.image_token_id == 4 and tok.vocab_size == 5  # <image> added as a special token
    assert tok.eos_id == 1 and tok.pad_id == 1 and tok.bos_id is None  # pad falls back to eos
    assert tok.encode("ab") == [2, 3] and tok.decode([4, 2, 3, 1]) == "ab"
    te = MultimodalTaskEncoder(tok, seq_length=8, image_mode=FixedTiles(image_size=16, patch_size=8))
    s = te.encode_sample(_captioning("k", 16, 16, "ab"))
    assert s.tokens.tolist() == [4, 4, 4, 4, 2, 3, 1]


def test_a_tokenizer_folder_without_tokenizer_json_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # not needed to read a tokenizer folder
    with pytest.raises(UsageError, match="has no tokenizer.json") as err:
        load_hf_tokenizer(tmp_path)
    assert len(str(err.value).splitlines()) == 1


# --------------------------------------------------------------------------------------------------------------
# geometry and token counts


def test_token_count_formulas():
    assert tile_num_tokens(32, 8) == 16
    assert tile_num_tokens(448, 14, pixel_shuffle_factor=4) == 256
    assert dynamic_num_tokens(6, 4) == 24 and dynamic_num_tokens(6, 4, 4) == 6
    with pytest.raises(ValueError):
        tile_num_tokens(30, 8)
    with pytest.raises(ValueError):
        dynamic_num_tokens(3, 4, 4)
    with pytest.raises(ValueError):
        tile_num_tokens(32, 8, pixel_shuffle_factor=2)


@pytest.mark.parametrize("step", [1, 2])
def test_fit_patch_grid_bounds_and_aspect(step):
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        h, w = (int(v) for v in torch.randint(8, 400, (2,), generator=gen))
        hp, wp = fit_patch_grid(h, w, 8, 8, 64, step)
        assert 8 <= hp * wp <= 64 and hp % step == 0 and wp % step == 0
        # aspect ratio kept as well as whole patches allow (within a factor ~2 for extreme shapes)
        if 0.5 <= w / h <= 2:
            assert abs(math.log((wp / hp) / (w / h))) < math.log(1.6)
    assert fit_patch_grid(48, 64, 8, 4, 64) == (6, 8)  # already in range: unchanged
    assert fit_patch_grid(400, 800, 8, 4, 32) == (4, 8)  # shrunk into range, 1:2 kept
    assert fit_patch_grid(8, 16, 8, 8, 32) == (2, 4)  # grown into range, 1:2 kept
    with pytest.raises(ValueError):
        fit_patch_grid(10, 10, 8, 5, 7, step=2)  # no multiple of 4 patches in [5, 7]


def _fit_patch_grid_by_every_height(height, width, patch_size, min_patches, max_patches, step):
    """The definition fit_patch_grid answers by: every height, in increasing order, the first best error kept."""
    aspect = width / height
    target = min(max((height / patch_size) * (width / patch_size), min_patches), max_patches)
    best, best_err = None, math.inf
    for hp in range(step, max_patches // step * step + 1, step):
        lo = max(-(-(-(-min_patches // hp)) // step) * step, step)
        hi = max_patches // hp // step * step
        if lo > hi:
            continue
        for w_float in (target / hp, hp * aspect):
            for wp in {math.floor(w_float / step) * step, math.ceil(w_float / step) * step}:
                wp = min(max(wp, lo), hi)
                err = abs(math.log(wp / hp) - math.log(aspect)) + abs(math.log(hp * wp) - math.log(target))
                if err < best_err - 1e-12:
                    best, best_err = (hp, wp), err
    return best


def test_fit_patch_grid_searches_only_near_heights_and_answers_as_every_height_would():
    gen = torch.Generator().manual_seed(1)
    for _ in range(400):
        patch_size = (8, 14, 16)[int(torch.randint(3, (1,), generator=gen))]
        step = 1 + int(torch.randint(3, (1,), generator=gen))
        min_patches = 1 + int(torch.randint(300, (1,), generator=gen))
        max_patches = min_patches + int(torch.randint(4500, (1,), generator=gen))
        h, w = (1 + int(v) for v in torch.randint(3000, (2,), generator=gen))
        expected = _fit_patch_grid_by_every_height(h, w, patch_size, min_patches, max_patches, step)
        if expected is None:
            with pytest.raises(ValueError):
                fit_patch_grid(h, w, patch_size, min_patches, max_patches, step)
        else:
            assert fit_patch_grid(h, w, patch_size, min_patches, max_patches, step) == expected, (h, w, step)
    # square images at the edge of a height's range, and a grid that only the largest heights allow
    assert fit_patch_grid(512, 512, 16, 256, 4096, 2) == _fit_patch_grid_by_every_height(512, 512, 16, 256, 4096, 2)
    assert fit_patch_grid(1, 4000, 16, 1, 64, 1) == _fit_patch_grid_by_every_height(1, 4000, 16, 1, 64, 1)


def test_patchify_layout():
    img = torch.arange(3 * 16 * 24, dtype=torch.float32).reshape(3, 16, 24)
    rows = patchify(img, 8)
    assert rows.shape == (2 * 3, 3 * 8 * 8)
    # patch (1, 2) is row 1*3+2; its first entries are channel 0, pixel row 8, columns 16..23
    assert torch.equal(rows[5, :8], img[0, 8, 16:24])
    assert torch.equal(rows[5, 64:72], img[1, 8, 16:24])


# --------------------------------------------------------------------------------------------------------------
# task encoder through energon


def test_fixed_tiles_through_energon(dataset):
    tok = ByteTokenizer()
    mode = FixedTiles(image_size=32, patch_size=PATCH)
    te = MultimodalTaskEncoder(tok, seq_length=64, image_mode=mode)
    batches = _dataset(str(dataset.path), te, batch_size=5)
    assert sum(b["input_ids"].shape[0] for b in batches) == NUM_SAMPLES
    for batch in batches:
        assert set(batch) == {"input_ids", "labels", "loss_mask", "position_ids", "modality_inputs"}
        b = batch["input_ids"].shape[0]
        for key in ("input_ids", "labels", "loss_mask", "position_ids"):
            assert batch[key].shape == (b, 64), key
        assert torch.equal(batch["position_ids"][0], torch.arange(64))
        x = batch["modality_inputs"]["images"]["vit"]["x"]
        assert set(batch["modality_inputs"]["images"]["vit"]) == {"x"}
        assert x.dtype == torch.float32 and x.shape == (b, 3, 32, 32)
        assert -1.0 - 1e-4 <= float(x.min()) and float(x.max()) <= 1.0 + 1e-4  # SigLIP normalization
        for row in range(b):
            n_img, length = _check_row_invariants(tok, batch, row)
            assert n_img == tile_num_tokens(32, PATCH) == 16
            assert batch["input_ids"][row, length - 1] == tok.eos_id
            assert CAPTION_RE.match(_text_of_row(tok, batch["input_ids"][row]))


def test_dynamic_resolution_through_energon(dataset):
    tok = ByteTokenizer()
    mode = DynamicResolution(patch_size=PATCH, min_patches=4, max_patches=40)
    te = MultimodalTaskEncoder(tok, seq_length=96, image_mode=mode)
    batches = _dataset(str(dataset.path), te, batch_size=4)
    assert sum(b["input_ids"].shape[0] for b in batches) == NUM_SAMPLES
    grids = set()
    for batch in batches:
        enc = batch["modality_inputs"]["images"]["vit"]
        assert set(enc) == {"x", "imgs_sizes", "packed_seq_params"}
        x, sizes, psp = enc["x"], enc["imgs_sizes"], enc["packed_seq_params"]
        b = batch["input_ids"].shape[0]
        assert x.ndim == 3 and x.shape[0] == 1 and x.shape[2] == 3 * PATCH * PATCH
        assert sizes.dtype == torch.long and sizes.shape == (b, 2)
        patches = (sizes // PATCH).prod(dim=1)
        assert isinstance(psp, PackedSeqParams) and psp.qkv_format == "thd"
        assert psp.cu_seqlens_q.dtype == torch.int32 and int(psp.cu_seqlens_q[0]) == 0
        assert torch.equal(psp.cu_seqlens_q, psp.cu_seqlens_kv)
        assert torch.equal(psp.cu_seqlens_q[1:] - psp.cu_seqlens_q[:-1], patches.to(torch.int32))
        assert int(psp.cu_seqlens_q[-1]) == x.shape[1]
        assert psp.max_seqlen_q == psp.max_seqlen_kv == int(patches.max())
        for row in range(b):
            n_img, _ = _check_row_invariants(tok, batch, row)
            assert n_img == int(patches[row])  # placeholders == the image's patches
            assert 4 <= n_img <= 40
            grids.add(tuple((sizes[row] // PATCH).tolist()))
    assert len({round(w / h, 2) for h, w in grids}) > 3  # aspect ratios survive


def test_dynamic_resolution_keeps_each_images_aspect(dataset):
    tok = ByteTokenizer()
    mode = DynamicResolution(patch_size=PATCH, min_patches=16, max_patches=64, pixel_shuffle_factor=4,
                             imgs_sizes_unit="patches")
    te = MultimodalTaskEncoder(tok, seq_length=64, image_mode=mode)
    samples = _dataset(str(dataset.path), te, batch_size=None)  # unbatched: EncodedSamples with keys
    assert len(samples) == NUM_SAMPLES
    for s in samples:
        meta = dataset.samples[s.__key__]
        (image,) = s.images
        hp, wp = image.grid
        assert image.pixels.shape == (hp * wp, 3 * PATCH * PATCH) and hp % 2 == 0 and wp % 2 == 0
        assert int((s.tokens == tok.image_token_id).sum()) == hp * wp // 4 == image.num_tokens
        assert abs(math.log((wp / hp) / (meta["width"] / meta["height"]))) < math.log(1.5), (meta, image.grid)
        assert tok.decode(s.tokens.tolist()) == meta["caption"]  # the caption belongs to this image
    batch = te.batch(samples[:3])
    enc = batch["modality_inputs"]["images"]["vit"]
    assert torch.equal(enc["imgs_sizes"], torch.tensor([list(s.images[0].grid) for s in samples[:3]]))


def _captioning(key, h, w, caption):
    return CaptioningSample(__key__=key, __restore_key__=(), image=torch.rand(3, h, w), caption=caption)


def test_truncation_never_cuts_image_tokens():
    tok = ByteTokenizer()
    te = MultimodalTaskEncoder(tok, seq_length=40,
                               image_mode=DynamicResolution(patch_size=PATCH, min_patches=4, max_patches=64))
    long_caption = "a small red square on a white background " * 5
    for h, w in [(32, 32), (40, 48), (24, 64), (16, 120)]:
        s = te.encode_sample(_captioning("k", h, w, long_caption))
        n_img = s.images[0].num_tokens
        assert len(s.tokens) == 40  # text tail dropped to fit the budget
        assert int((s.tokens == tok.image_token_id).sum()) == n_img  # every image token kept
        assert tok.decode(s.tokens.tolist()) == long_caption[: 40 - n_img]  # the head of the caption kept
        assert int(s.tokens[-1]) != tok.eos_id  # eos was part of the dropped tail
        whole = n_img + len(tok.encode(long_caption)) + 1
        assert (s.cut_tokens, s.needed_tokens) == (whole - 40, whole)  # what the cut took rides with the sample
        assert s.answer_tokens == whole - n_img and s.cut_answer_tokens == whole - 40
    # fits exactly without truncation: caption + eos
    s = te.encode_sample(_captioning("k", 16, 16, "red"))
    assert s.tokens.tolist() == [tok.image_token_id] * 4 + tok.encode("red") + [tok.eos_id]
    assert s.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 1, 0]
    assert s.labels.tolist()[3:7] == tok.encode("red") + [tok.eos_id]
    assert s.cut_tokens == s.cut_answer_tokens == 0 and s.answer_tokens == 4
    # an image whose tokens leave no room for text is too long (the loader makes it a tombstone, counted)
    with pytest.raises(TooLong, match="needs 50 tokens") as too_long:
        te.encode_sample(_captioning("too_big", 64, 48, "x"))  # 8x6 = 48 > 40 tokens
    assert too_long.value.needed_tokens == 50
    with pytest.raises(TooLong, match="raise seq_length"):
        MultimodalTaskEncoder(tok, seq_length=16).encode_sample(
            _captioning("exact", 32, 32, "x"))  # 16 image tokens == seq_length: nothing to learn


def test_too_long_images_are_skipped_in_the_loader(dataset):
    tok = ByteTokenizer()
    counter = SkippedSampleCounter()
    mode = DynamicResolution(patch_size=PATCH, min_patches=4, max_patches=144)
    te = MultimodalTaskEncoder(tok, seq_length=48, image_mode=mode)
    expected_skips = sum(mode.num_tokens(m["height"], m["width"]) + 1 > 48 for m in dataset.samples.values())
    assert 0 < expected_skips < NUM_SAMPLES
    batches = _dataset(str(dataset.path), te, batch_size=4, counter=counter)
    seen = sum(b["input_ids"].shape[0] for b in batches)
    assert seen == NUM_SAMPLES - expected_skips
    assert counter.count == expected_skips and counter.counts() == {"too_long": expected_skips}
    for batch in batches:
        for row in range(batch["input_ids"].shape[0]):
            _check_row_invariants(tok, batch, row)


def test_text_only_samples_contribute_no_encoder_input():
    tok = ByteTokenizer()
    te = MultimodalTaskEncoder(tok, seq_length=32, image_mode=FixedTiles(image_size=16, patch_size=8))
    text = [te.encode_sample(TextSample(__key__=f"t{i}", __restore_key__=(), text="hello")) for i in range(2)]
    assert all(not s.images for s in text)
    batch = te.batch(text)
    assert batch["modality_inputs"] == {}
    assert not bool((batch["input_ids"] == tok.image_token_id).any())
    mixed = te.batch([text[0], te.encode_sample(_captioning("c", 20, 30, "hi")), text[1]])
    assert mixed["modality_inputs"]["images"]["vit"]["x"].shape == (1, 3, 16, 16)
    assert (mixed["input_ids"] == tok.image_token_id).sum(dim=1).tolist() == [0, 4, 0]


def test_sequence_packing_through_energon(dataset):
    tok = ByteTokenizer()
    te = MultimodalTaskEncoder(tok, seq_length=128, pack_sequences=True,
                               image_mode=DynamicResolution(patch_size=PATCH, min_patches=4, max_patches=24))
    batches = _dataset(str(dataset.path), te, batch_size=2, packing_buffer_size=8)
    rows = 0
    captions = 0
    for batch in batches:
        pk = batch["packing_kwargs"]
        enc = batch["modality_inputs"]["images"]["vit"]
        b, s = batch["input_ids"].shape
        assert b == 1 and s % te.seq_length == 0  # the rows laid end to end: megatron-core's THD takes batch 1
        rows += s // te.seq_length
        cu, cu_p = pk["cu_seqlens_q"], pk["cu_seqlens_q_padded"]
        assert int(cu_p[-1]) == s == pk["total_tokens"] and int(cu[0]) == int(cu_p[0]) == 0
        assert bool(((cu_p[1:] - cu_p[:-1]) >= (cu[1:] - cu[:-1])).all())
        # placeholders in the whole batch == patches in the packed image buffer
        assert int((batch["input_ids"] == tok.image_token_id).sum()) == enc["x"].shape[1]
        flat_pos = batch["position_ids"].reshape(-1)
        for start, end in zip(cu_p[:-1].tolist(), cu_p[1:].tolist()):
            assert torch.equal(flat_pos[start:end], torch.arange(end - start))  # positions restart per sequence
        lengths = (cu[1:] - cu[:-1]).tolist()
        flat_mask = batch["loss_mask"].reshape(-1)
        for start, n in zip(cu_p[:-1].tolist(), lengths):
            assert float(flat_mask[start + n - 1]) == 0.0  # no loss across a sequence boundary
        captions += len(lengths)
    assert captions == NUM_SAMPLES and rows < NUM_SAMPLES  # several samples share a row


# --------------------------------------------------------------------------------------------------------------
# corrupt samples


def test_corrupt_sample_is_skipped_and_counted(corrupt_dataset):
    assert corrupt_dataset.corrupt_keys == ["sample_000007"]
    counter = SkippedSampleCounter()
    te = MultimodalTaskEncoder(ByteTokenizer(), seq_length=64, image_mode=FixedTiles(image_size=32, patch_size=8))
    samples = _dataset(str(corrupt_dataset.path), te, batch_size=None, counter=counter)
    keys = sorted(s.__key__ for s in samples)
    assert keys == sorted(k for k in corrupt_dataset.samples if k != "sample_000007")
    assert counter.count == 1
    (record,) = counter.records
    assert record.key == "sample_000007" and record.reason == "unreadable"
    assert "DecodingError" in record.error or "UnidentifiedImageError" in record.error


def test_corrupt_sample_counted_across_worker_processes(corrupt_dataset):
    te = MultimodalTaskEncoder(ByteTokenizer(), seq_length=64, image_mode=FixedTiles(image_size=32, patch_size=8))
    loader, counter = get_multimodal_train_loader(corrupt_dataset.path, te, batch_size=4, num_workers=1,
                                                  repeat=False)
    seen = sum(b["input_ids"].shape[0] for b in loader)
    assert seen == 11 and counter.count == 1


# --------------------------------------------------------------------------------------------------------------
# lane merging


def _dyn_input(counts, d=12, offset=0.0):
    x = torch.arange(sum(counts) * d, dtype=torch.float32).reshape(1, sum(counts), d) + offset
    cu = torch.tensor([0] + list(torch.tensor(counts).cumsum(0).tolist()), dtype=torch.int32)
    return {"x": x, "imgs_sizes": torch.tensor([[8 * c, 8] for c in counts]),
            "packed_seq_params": PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(),
                                                 max_seqlen_q=max(counts), max_seqlen_kv=max(counts))}


def test_merge_dynamic_resolution_lanes():
    a, b = _dyn_input([3, 5]), _dyn_input([7, 2, 4], offset=1000.0)
    m = merge_encoder_inputs([a, b])
    assert m["x"].shape == (1, 21, 12) and torch.equal(m["x"][:, 8:], b["x"])
    assert torch.equal(m["imgs_sizes"], torch.cat([a["imgs_sizes"], b["imgs_sizes"]]))
    psp = m["packed_seq_params"]
    assert psp.cu_seqlens_q.tolist() == [0, 3, 8, 15, 17, 21] and psp.cu_seqlens_kv.tolist() == [0, 3, 8, 15, 17, 21]
    assert psp.cu_seqlens_q.dtype == torch.int32
    assert psp.max_seqlen_q == psp.max_seqlen_kv == 7 and psp.qkv_format == "thd"
    # the lanes' inputs are not modified
    assert a["packed_seq_params"].cu_seqlens_q.tolist() == [0, 3, 8]


def test_merge_identical_shapes_follows_the_schema_not_the_shape():
    # dynamic resolution: two [1, 4, 12] buffers -> one [1, 8, 12] packed buffer (dim 1)
    dyn = merge_encoder_inputs([_dyn_input([4]), _dyn_input([4], offset=100.0)])
    assert dyn["x"].shape == (1, 8, 12) and dyn["packed_seq_params"].cu_seqlens_q.tolist() == [0, 4, 8]
    # fixed tiles: two [1, 3, 16, 16] stacks (one image per lane) -> [2, 3, 16, 16] (dim 0)
    t1, t2 = torch.zeros(1, 3, 16, 16), torch.ones(1, 3, 16, 16)
    fixed = merge_encoder_inputs([{"x": t1}, {"x": t2}])
    assert fixed["x"].shape == (2, 3, 16, 16) and torch.equal(fixed["x"][1], t2[0])
    # the same holds for 3-d fixed inputs that look like a packed buffer
    fx = merge_encoder_inputs([{"x": torch.zeros(1, 4, 12)}, {"x": torch.ones(1, 4, 12)}])
    assert fx["x"].shape == (2, 4, 12)


def test_merge_rejects_unknown_keys_and_mixed_schemas():
    with pytest.raises(TypeError, match="pixel_values"):
        merge_encoder_inputs([{"x": torch.zeros(1, 3, 8, 8), "pixel_values": torch.zeros(1)}])
    bad = _dyn_input([2])
    bad["attention_mask"] = torch.ones(2)
    with pytest.raises(TypeError, match="attention_mask"):
        merge_encoder_inputs([_dyn_input([3]), bad])
    with pytest.raises(ValueError):
        merge_encoder_inputs([_dyn_input([3]), {"x": torch.zeros(1, 3, 8, 8)}])
    assert merge_encoder_inputs([{}, None]) == {}


def test_merging_lane_batches_equals_batching_them_together(dataset):
    tok = ByteTokenizer()
    te = MultimodalTaskEncoder(tok, seq_length=96,
                               image_mode=DynamicResolution(patch_size=PATCH, min_patches=4, max_patches=40))
    samples = _dataset(str(dataset.path), te, batch_size=None)[:6]
    lanes = [te.batch(samples[:2]), te.batch(samples[2:3]), te.batch(samples[3:])]
    merged = merge_modality_inputs([lane["modality_inputs"] for lane in lanes])["images"]["vit"]
    whole = te.batch(samples)["modality_inputs"]["images"]["vit"]
    assert torch.equal(merged["x"], whole["x"]) and torch.equal(merged["imgs_sizes"], whole["imgs_sizes"])
    assert torch.equal(merged["packed_seq_params"].cu_seqlens_q, whole["packed_seq_params"].cu_seqlens_q)
    assert merged["packed_seq_params"].max_seqlen_q == whole["packed_seq_params"].max_seqlen_q
    fixed = MultimodalTaskEncoder(tok, seq_length=64, image_mode=FixedTiles(image_size=16, patch_size=8))
    caps = [_captioning(f"c{i}", 20 + i, 30, "x") for i in range(3)]
    enc = [fixed.encode_sample(c) for c in caps]
    merged = merge_modality_inputs([fixed.batch(enc[:1])["modality_inputs"], {},
                                    fixed.batch(enc[1:])["modality_inputs"]])
    assert torch.equal(merged["images"]["vit"]["x"], fixed.batch(enc)["modality_inputs"]["images"]["vit"]["x"])
