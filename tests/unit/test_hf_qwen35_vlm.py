"""The whole Qwen3.5 VLM (vision tower, patch merger, language model, image tokens injected at the placeholders,
3-D multimodal RoPE positions) against transformers: tiny random `Qwen3_5ForConditionalGeneration` and
`Qwen3_5MoeForConditionalGeneration` models written by transformers are read as `--pretrained` folders through the
provider's hf_settings / hf_tensor_map (text map and vision map together) into the MimoModel a run builds (local
backend, fp32, CPU); both compute the same teacher-forced logits of token ids with several images of different
sizes in one sequence, transformers making its own 3-D positions. export-hf's map gives the folder back bit for
bit, and transformers loads the export with the same logits."""

from __future__ import annotations

import pytest
import torch

from helpers import relative_error, world_of_one
from mimo.core.checkpoint.hf_load import global_tensors, hf_loader
from mimo.core.config import CheckpointOptions, RunConfig, TrainingOptions
from mimo.core.run.plan import prepare
from mimo.core.run.world import join
from mimo.plugins.kit import safetensors_io
from mimo.plugins.kit.safetensors_io import FolderSource
from mimo.plugins.kit.tensor_map import to_hf
from mimo.providers import qwen35
from mimo.providers.qwen35.positions import mrope_positions
from qwen35_models import TOKENS, save_reference

TOLERANCE = 1e-4  # max |mimo - reference| / max |reference|
IMAGE, START, END = TOKENS["image_token_id"], TOKENS["vision_start_token_id"], TOKENS["vision_end_token_id"]
# 4-pixel patches merged 2 x 2 (the reference's tower): images of 16^2 to 32^2 pixels, 4 to 16 LLM tokens each
PIXELS = ["min_pixels=256", "max_pixels=1024"]
ROWS = [[(16, 40), (32, 24), (20, 20)], [(24, 16)]]  # images of each row, (height, width) in pixels


def _inputs(settings, seed: int = 5) -> dict:
    """Two rows of text and images (<|vision_start|>, the image's placeholders, <|vision_end|>), as long as each
    other: the tokens, the processed images (mimo's image mode: the processor's pixels) and their grids."""
    gen = torch.Generator().manual_seed(seed)
    mode = settings.image_mode()
    rows, images = [], []
    for sizes in ROWS:
        row = torch.randint(0, 256, (3,), generator=gen).tolist()
        for h, w in sizes:
            image = mode.process(torch.rand(3, h, w, generator=gen))
            images.append(image)
            row += [START] + [IMAGE] * image.num_tokens + [END] + torch.randint(0, 256, (5,), generator=gen).tolist()
        rows.append(row)
    length = max(len(r) for r in rows)
    rows = [r + torch.randint(0, 256, (length - len(r),), generator=gen).tolist() for r in rows]
    input_ids = torch.tensor(rows)
    grids = [im.grid_thw for im in images]
    per_row = [len(sizes) for sizes in ROWS]
    merge = settings.spatial_merge_size
    llm_grids = [(t, h // merge, w // merge) for t, h, w in grids]
    positions, start = [], 0
    for row, n in zip(input_ids, per_row):
        positions.append(mrope_positions(row, IMAGE, llm_grids[start:start + n]))
        start += n
    return {"input_ids": input_ids, "position_ids": torch.stack(positions, dim=1), "images": images,
            "pixel_values": mode.collate(images)["pixel_values"], "grid_thw": torch.tensor(grids)}


def _reference_logits(reference, inputs: dict, pixel_values: torch.Tensor | None = None) -> torch.Tensor:
    ids = inputs["input_ids"]
    with torch.no_grad():
        return reference(input_ids=ids, pixel_values=inputs["pixel_values"] if pixel_values is None else pixel_values,
                         image_grid_thw=inputs["grid_thw"], mm_token_type_ids=(ids == IMAGE).int()).logits


def _mimo_logits(model, inputs: dict) -> torch.Tensor:
    ids = inputs["input_ids"]
    modality = {"images": {"visual": {"pixel_values": inputs["pixel_values"], "grid_thw": inputs["grid_thw"]}}}
    with torch.no_grad():
        logits, _ = model(input_ids=ids, position_ids=inputs["position_ids"], attention_mask=None, labels=None,
                          loss_mask=torch.ones(ids.shape), modality_inputs=modality)
    return logits


def _pretrained_model(provider: str, folder):
    """The run's MimoModel for `--pretrained folder` (its settings over the provider's), the folder loaded."""
    config = RunConfig(provider=provider, provider_settings=["backend=local", *PIXELS],
                       training=TrainingOptions(device="cpu", micro_batch_size=2),
                       checkpoint=CheckpointOptions(pretrained=folder))
    plan = prepare(config, world_size=1)
    model = join(plan).build_model()
    hf_loader(plan, model)()
    return plan.settings, model.eval()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_the_vlm_computes_the_reference_logits_with_images_and_exports_bit_for_bit(tmp_path, moe):
    import transformers

    reference, folder = save_reference(tmp_path / "hf", moe)
    hf_config = safetensors_io.read_config(folder)
    fields = qwen35.hf_settings(hf_config=hf_config, part="model")
    assert fields["vision_depth"] == 1 and fields["patch_size"] == 4 and fields["image_token_id"] == IMAGE
    with world_of_one():
        settings, model = _pretrained_model("qwen3.5-vl-moe-tiny" if moe else "qwen3.5-vl-tiny", folder)
        inputs = _inputs(settings)
        # mimo's 3-D positions are transformers' own
        want_positions, _ = reference.model.get_rope_index(
            inputs["input_ids"], (inputs["input_ids"] == IMAGE).int(), image_grid_thw=inputs["grid_thw"])
        assert torch.equal(inputs["position_ids"], want_positions)
        want = _reference_logits(reference, inputs)
        got = _mimo_logits(model, inputs)
        assert got.shape == want.shape and relative_error(got, want) <= TOLERANCE, relative_error(got, want)
        # the images and their 3-D positions matter: other pixels, or text positions, move the logits far beyond
        # the tolerance
        other = _reference_logits(reference, inputs, torch.flip(inputs["pixel_values"], dims=[0]))
        assert relative_error(other, want) > 100 * TOLERANCE
        text = torch.arange(inputs["input_ids"].shape[1]).expand_as(inputs["input_ids"])
        assert relative_error(_mimo_logits(model, {**inputs, "position_ids": text}), want) > 100 * TOLERANCE

        export = qwen35.hf_export(settings=settings)
        tensors = to_hf(export.tensors, global_tensors(model))
    with FolderSource(folder) as source:
        assert sorted(tensors) == sorted(n for n in source.names() if not n.startswith("mtp."))
        for name, tensor in tensors.items():
            assert torch.equal(tensor, source.read(name)), name
    safetensors_io.save(tmp_path / "export", tensors, export.config)
    for name, text in export.files.items():
        (tmp_path / "export" / name).write_text(text)
    cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    reloaded = cls.from_pretrained(tmp_path / "export").eval()
    assert relative_error(_reference_logits(reloaded, inputs), want) <= TOLERANCE
    back = qwen35.hf_settings(hf_config=export.config, part="model")
    assert back == {k: v for k, v in fields.items()}  # the same model
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "export")
    assert processor.patch_size == settings.patch_size and processor.merge_size == settings.spatial_merge_size
