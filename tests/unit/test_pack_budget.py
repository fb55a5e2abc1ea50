"""Packs that fit: rows bounded by the LLM's tokens and by an image budget that the memory plan counts."""

from __future__ import annotations

import pytest
import torch
from megatron.energon import CaptioningSample, TextSample

from mimo.core.config import CheckpointOptions, DataOptions, MemoryOptions, RunConfig, TrainingOptions
from mimo.core.memory import fit
from mimo.core.memory.pack_budget import GRAIN
from mimo.core.run.plan import prepare
from mimo.data import ByteTokenizer, FixedTiles, MultimodalTaskEncoder
from mimo.core.telemetry.skip_report import skip_stop_message
from mimo.data.counts import DataCounts
from mimo.data.skips import OVER_IMAGE_BUDGET, TooLong
from mimo.plugins.context import packing_buffer_for

SEQ = 256


def encoder(budget=None) -> MultimodalTaskEncoder:
    # 16 x 16 tiles of 4-pixel patches: 16 image tokens an image
    return MultimodalTaskEncoder(ByteTokenizer(), seq_length=SEQ, image_mode=FixedTiles(image_size=16, patch_size=4),
                                 pack_sequences=True, image_token_budget=budget)


def captions(count: int, images: int = 1) -> list:
    out = []
    for i in range(count):
        base = dict(__key__=f"s{i}", __restore_key__=())
        out.append(CaptioningSample(**base, image=[torch.rand(3, 16, 16)] * images, caption="a caption")
                   if images else TextSample(**base, text="a caption"))
    return out


def test_rows_close_at_the_image_budget_as_at_the_token_budget():
    free, bounded = encoder(), encoder(budget=48)
    samples = captions(24)
    for te, most in ((free, None), (bounded, 48)):
        encoded = [te.encode_sample(s) for s in samples]
        groups = te.select_samples_to_pack(encoded)
        assert sorted(s.__key__ for g in groups for s in g) == sorted(s.__key__ for s in encoded)  # none lost
        for group in groups:
            assert sum(len(s.tokens) for s in group) <= SEQ
            if most:
                assert sum(im.num_tokens for s in group for im in s.images) <= most
        rows = len(groups)
        if most is None:
            unbounded = rows
    assert rows > unbounded  # the budget closed rows the tokens alone would have filled further
    text = [bounded.encode_sample(s) for s in captions(6, images=0)]  # no images: the token budget alone
    assert len(bounded.select_samples_to_pack(text)) == 1


def test_a_sample_whose_images_exceed_the_budget_is_skipped_for_its_own_reason():
    te = encoder(budget=24)
    te.encode_sample(captions(1, images=1)[0])  # 16 image tokens: fits
    with pytest.raises(TooLong, match=r"its images take 32 image tokens, more than a packed row's 24 "
                                      r"\(--pack-image-tokens\)") as raised:
        te.encode_sample(captions(1, images=2)[0])
    assert raised.value.reason == OVER_IMAGE_BUDGET  # not "too long for seq_length": a longer one would not help


def test_the_stop_line_names_images_over_the_budget_apart_with_their_own_fix():
    counts = DataCounts(samples=60, too_long=4, over_image_budget=36)
    line = skip_stop_message(counts, 0.1, "DATA", seq_length=4096)
    assert ("40 of the 100 samples read were skipped (40.0%: 4 too long for seq_length 4096, 36 with images over a "
            "packed row's image tokens (--pack-image-tokens))") in line
    assert "raise seq_length" in line and "--set max_pixels=N) or raise --pack-image-tokens" in line
    assert counts.skipped == 40 and DataCounts(**{"samples": 1, "too_long": 2}).over_image_budget == 0  # older state


def slice_config(tmp_path, **data) -> RunConfig:
    return RunConfig(provider="nemotron-moe-vlm-52l",
                     provider_settings=["hybrid_pattern=MEMEM*EMEM", "num_experts=16"],
                     training=TrainingOptions(precision="bf16", micro_batch_size=1, num_microbatches=8),
                     data=DataOptions(data=tmp_path, **data), memory=MemoryOptions(gpu_memory=139),
                     checkpoint=CheckpointOptions())


def test_the_budget_is_the_most_that_fits_and_the_estimate_counts_it(tmp_path):
    plan = prepare(slice_config(tmp_path), world_size=1, planning=True)
    assert plan.pack_image_tokens is not None and plan.pack_image_tokens % GRAIN == 0
    assert fit.fits(plan, planning=True)
    fitted = plan.pack_image_tokens
    if fitted < plan.settings.seq_length:  # one grain more would not fit
        plan.pack_image_tokens = fitted + GRAIN
        assert not fit.fits(plan, planning=True)
    # the encoders' tokens per row follow the budget: twice the budget, about twice their activations
    images = {}
    for budget in (1024, 2048):
        plan.pack_image_tokens = budget
        [rank] = fit.estimate_plan(plan)
        images[budget] = next(m for m in rank.modules if m.module == "images")
    assert images[2048].tokens == 2 * images[1024].tokens > 0
    given = prepare(slice_config(tmp_path, pack_image_tokens=512), world_size=1, planning=True)
    assert given.pack_image_tokens == 512
    unpacked = prepare(slice_config(tmp_path, pack_sequences=False), world_size=1, planning=True)
    assert unpacked.pack_image_tokens is None


def test_a_budget_above_the_row_is_refused_in_one_line(tmp_path):
    from mimo.errors import UsageError

    with pytest.raises(UsageError, match=r"^--pack-image-tokens 9000 is more than a row holds \(seq_length 8192\)"):
        prepare(slice_config(tmp_path, pack_image_tokens=9000), world_size=1, planning=True)


def test_the_default_packing_buffer_holds_four_rows_of_short_samples():
    assert packing_buffer_for(8192) == 256 and packing_buffer_for(2048) == 64 and packing_buffer_for(256) == 64
