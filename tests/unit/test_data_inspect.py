"""`mimo data inspect` and `preview` in-process: a LLaVA-style conversion (one image, two images in the text, text
only) read without a provider and through mock-vlm's own task encoder, with the token counts worked out by hand
from its plain template and byte tokenizer; a blend read by weight; corrupt and too-long samples; the packer
reached through the encoder; bad inputs in one line."""

from __future__ import annotations

import dataclasses
import re

import pytest

from format_datasets import LLAVA_SIZES, build_text, write_llava
from mimo.core.config import RunConfig
from mimo.core.run.data_encoder import provider_encoder
from mimo.data import DynamicResolution, FixedTiles, write_sample_dataset
from mimo.data.convert import convert_llava
from mimo.data.inspection import histogram, inspect_dataset, pack_rows, percentiles
from mimo.data.preview import preview_lines
from mimo.data.sample_reader import SampleReader, split_sizes
from mimo.data.sample_view import Viewer
from mimo.errors import UsageError

# mock-vlm's plain template over bytes; an image is one 32-pixel tile of 8-pixel patches: 16 patches, 16 tokens.
# one image:  [16 image] "\nWhat is shown?" "\n" | "A red box N." </s>                      = 32 + 13 = 45, 13 trained
# two images: "Compare " [16] " with " [16] "." "\n" | "The first is taller." </s> | "Sure?\n" | "Yes." </s>
#                                                                                    = 48 + 21 + 6 + 5 = 80, 26 trained
# text only:  "Be brief.\n" | "Name a colour.\n" | "Blue." </s>                          = 10 + 15 + 6 = 31, 6 trained
TOTAL = {0: 45, 1: 80, 2: 31}
TRAINED = {0: 13, 1: 26, 2: 6}


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    write_llava(root / "src")
    convert_llava(root / "src" / "llava.json", root / "src" / "images", root / "ds", say=lambda line: None)
    return root / "ds"


def encoder_of(provider: str, path, *sets: str):
    config = RunConfig(provider=provider, provider_settings=list(sets))
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, data=path))
    return provider_encoder(config).encoder


def test_percentiles_and_a_histogram_with_a_bin_ending_at_seq_length():
    assert percentiles(range(1, 101)) == {"p50": 50, "p90": 90, "p99": 99, "max": 100, "mean": 50.5}
    assert percentiles([]) is None
    bins = histogram(list(range(10, 101)), bins=8, edge=64)
    assert any(high == 64 for _, high, _ in bins) and sum(n for _, _, n in bins) == 91
    assert bins[0][0] <= 10 and bins[-1][1] >= 100


def test_image_modes_say_how_many_patches_an_image_takes():
    assert FixedTiles(image_size=32, patch_size=8).num_patches(480, 640) == 16
    mode = DynamicResolution(patch_size=8, min_patches=4, max_patches=64)
    rows, cols = mode.grid(48, 96)
    assert mode.num_patches(48, 96) == rows * cols


def test_inspect_without_a_provider_reports_what_needs_none(llava):
    result = inspect_dataset(llava, limit=None)
    assert result.splits == {"train": 6, "val": 0, "test": 0} and result.read == 6
    assert dict(result.formats) == {"chat": 6} and dict(result.images_per_sample) == {0: 2, 1: 2, 2: 2}
    sizes = [LLAVA_SIZES[n] for n in ("a.jpg", "b.png", "c.jpg", "a.jpg", "b.png", "c.jpg")]
    assert sorted(result.columns["image_width"]) == sorted(w for w, _ in sizes)
    assert sorted(result.columns["image_height"]) == sorted(h for _, h in sizes)
    assert "total_tokens" not in result.columns and result.rows == []
    lines = result.lines()
    assert all(len(line) <= 80 for line in lines), lines
    assert "formats: chat 6" in lines and "images per sample: 0: 2, 1: 2, 2: 2" in lines


def test_inspect_counts_what_mock_vlms_encoder_makes_and_packs(llava):
    encoder = encoder_of("mock-vlm", llava)
    assert encoder.seq_length == 64 and encoder.pack_sequences
    result = inspect_dataset(llava, encoder=encoder, provider="mock-vlm", limit=None)
    kinds = [i % 3 for i in range(6)]
    assert sorted(result.columns["total_tokens"]) == sorted(TOTAL[k] for k in kinds)
    assert sorted(result.columns["trained_tokens"]) == sorted(TRAINED[k] for k in kinds)
    assert result.columns["tokens_per_image"] == [16] * 6 and result.columns["patches_per_image"] == [16] * 6
    assert sorted(result.columns["image_tokens"]) == [0, 0, 16, 16, 32, 32]
    # the two two-image samples (80 tokens) are cut to 64: 16 tokens each, 10 of their 26 trained ones
    assert (result.cut_samples, result.cut_tokens, result.cut_answer_tokens) == (2, 32, 20)
    assert result.answer_tokens == sum(TRAINED[k] for k in kinds)
    # first-fit decreasing over 64, 64, 45, 45, 31, 31: the two short ones share a row
    assert sorted(result.rows) == [45, 45, 62, 64, 64] and result.encoded == 6
    lines = result.lines()
    assert all(len(line) <= 80 for line in lines), lines
    assert any(line.startswith("rows: 6 samples packed into 5 rows of 64 tokens: 88% full") for line in lines)
    data = result.as_dict()
    assert data["packing"]["rows"] == 5 and data["stats"]["total_tokens"]["max"] == 80


def test_text_tokens_are_the_samples_tokens_that_are_not_images(llava):
    result = inspect_dataset(llava, encoder=encoder_of("mock-vlm", llava), provider="mock-vlm", limit=None)
    pairs = sorted(zip(result.columns["total_tokens"], result.columns["image_tokens"], result.columns["text_tokens"]))
    assert [(total, text) for total, _, text in pairs] == [(31, 31), (31, 31), (45, 29), (45, 29), (80, 48), (80, 48)]


def test_pack_rows_goes_through_the_encoders_packer(llava):
    """A changed packer (another budget, another rule) is what inspect reports: it calls the encoder's own."""
    encoder = encoder_of("mock-vlm", llava)
    views = [Viewer(encoder).view(read) for read in SampleReader(llava, encoder=encoder)]
    encoded = [v.encoded for v in views]
    calls = []

    def one_row(samples):
        calls.append(len(samples))
        return [list(samples)]

    encoder.select_samples_to_pack = one_row
    assert pack_rows(encoder, encoded, buffer_size=4) == [sum(len(e.tokens) for e in encoded[:4]),
                                                         sum(len(e.tokens) for e in encoded[4:])]
    assert calls == [4, 2]


def test_samples_too_long_for_seq_length_are_counted_with_their_length(llava):
    result = inspect_dataset(llava, encoder=encoder_of("mock-vlm", llava, "seq_length=20"), provider="mock-vlm")
    assert dict(result.skip_counts) == {"too_long": 6} and result.rows == []
    assert sorted(result.columns["total_tokens"]) == [31, 31, 45, 45, 80, 80]
    assert "needs 80 tokens" in " ".join(r.error for r in result.skipped)


def test_a_corrupt_sample_is_skipped_and_named(tmp_path):
    info = write_sample_dataset(tmp_path / "ds", num_samples=8, shard_size=8, corrupt_indices=[3])
    result = inspect_dataset(tmp_path / "ds")
    assert result.read == 8 and dict(result.skip_counts) == {"unreadable": 1}
    assert result.skipped[0].key == info.corrupt_keys[0] and dict(result.formats) == {"captions": 7}
    assert any(info.corrupt_keys[0] in line for line in result.lines())


def test_a_damaged_shard_skips_its_unreadable_samples(tmp_path):
    write_sample_dataset(tmp_path / "ds", num_samples=16, shard_size=8)
    shard = sorted((tmp_path / "ds").glob("*.tar"))[0]
    with open(shard, "r+b") as f:  # cut short, as an interrupted copy leaves it
        f.truncate(shard.stat().st_size // 2)
    result = inspect_dataset(tmp_path / "ds")
    assert result.read == 16 and result.skip_counts["unreadable"] >= 4 and result.formats["captions"] >= 8
    assert "its shard is damaged at this sample" in result.skipped[0].error


def test_a_megatron_bridge_dataset_reads_as_its_chat(tmp_path):
    from test_foreign_samples import bridge_dataset

    bridge_dataset(tmp_path / "bridge")
    result = inspect_dataset(tmp_path / "bridge", encoder=encoder_of("mock-vlm", tmp_path / "bridge"),
                             provider="mock-vlm")
    assert dict(result.formats) == {"bridge chat": 12} and not result.skip_counts
    assert "declared samples: ChatMLWebdataset (Bridge)" in result.lines()


def test_a_blend_is_read_by_weight(llava, tmp_path):
    import random

    build_text(tmp_path / "text", random.Random(0))
    blend = tmp_path / "blend.yaml"
    blend.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
                     f"      - weight: 3\n        path: {llava}\n      - weight: 1\n        path: text\n")
    reader = SampleReader(blend)
    assert [(m.sample_type, m.weight, m.samples) for m in reader.members] == [("CrudeSample", 0.75, 6),
                                                                              ("TextSample", 0.25, 6)]
    assert [read.member for read in list(reader)[:8]] == [0, 0, 1, 0, 0, 0, 1, 0]
    result = inspect_dataset(blend, limit=8)
    assert dict(result.formats) == {"chat": 6, "text": 2} and split_sizes(blend) == {"train": 12}
    assert all(len(line) <= 80 for line in result.lines())


def test_preview_shows_turns_images_and_the_trained_tokens(llava):
    encoder = encoder_of("mock-vlm", llava)
    views = [Viewer(encoder).view(read) for read in SampleReader(llava, encoder=encoder)][:3]
    lines = preview_lines(views, encoder, "mock-vlm", [str(llava)])
    text = "\n".join(lines)
    assert all(len(line) <= 80 for line in lines), text
    assert "  user       <image 64x48: 16 patches, 16 tokens>\\nWhat is shown?\\n" in lines
    assert "  assistant  [[A red box 0.</s>]]" in lines
    assert "<image 40x90: 16 patches, 16 tokens>" in text and "<image 120x80: 16 patches, 16 tokens>" in text
    # 80 tokens cut to 64: the cut falls in the first answer, 16 tokens after its start
    assert "  assistant  [[The first is tal]]" in lines and "Sure?" not in text
    assert "(cut here by seq_length 64: 16 more tokens, 10 of them trained, are" in text
    assert ["  system     Be brief.\\n", "  user       Name a colour.\\n", "  assistant  [[Blue.</s>]]"] == lines[-3:]


def test_preview_without_a_provider_shows_the_turns_as_read(llava):
    views = [Viewer().view(read) for read in SampleReader(llava)][:2]
    lines = preview_lines(views)
    assert "  user       Compare <image 40x90> with <image 120x80>." in lines
    assert "  assistant  The first is taller." in lines and not any("[[" in line for line in lines)
    shortened = preview_lines(views, chars=6)  # a run of text longer than --chars keeps its head and tail
    assert "  assistant  The  ... r." in shortened
    assert any(line.startswith("  user       Comp ... e <image 40x90> with <image 120x80>") for line in shortened)


def test_bad_inputs_are_one_line(llava, tmp_path):
    (tmp_path / "plain").mkdir()
    for path, split, expected in [(tmp_path / "none", "train", "no such file or directory"),
                                  (tmp_path / "plain", "train", "a folder without .nv-meta"),
                                  (llava, "eval", "has no split 'eval': its splits are train (6 samples)"),
                                  (llava, "val", "has no samples in split 'val'")]:
        with pytest.raises(UsageError, match=re.escape(expected)) as err:
            SampleReader(path, split)
        assert "\n" not in str(err.value)
