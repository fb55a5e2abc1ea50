"""The embedding merge without device syncs (core/parallel/embedding_merge.py): the loop hands MimoModel the
placeholders' positions found on the host, and the merged embeddings, the losses and every gradient are bit for
bit those of megatron-core's own merge, for both built-in providers (mock-vlm's fixed tiles with some samples
without an image, Nemotron's dynamic-resolution RADIO with its image sizes left on the host)."""

from __future__ import annotations

import pytest
import torch

from helpers import world_of_one
from mimo.core.config import RunConfig, TrainingOptions
from mimo.core.parallel.embedding_merge import merge, placeholder_rows
from mimo.core.run.plan import prepare
from mimo.core.forward.batch_transfer import to_device
from mimo.core.run.world import join


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


def _loss_and_grads(model, batch, rows):
    model.zero_grad_buffer()
    inputs = to_device({k: v for k, v in batch.items() if k != "modality_inputs"}, torch.device("cpu"),
                       torch.float32)
    modality = to_device(batch["modality_inputs"], torch.device("cpu"), torch.float32)
    output, _ = model(**inputs, modality_inputs=modality or None, placeholder_rows=rows)
    output.sum().backward()
    grads = {name: p.main_grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return output.detach(), grads


@pytest.mark.parametrize("provider, settings", [
    ("mock-vlm", ["image_size=32", "patch_size=8", "vision_hidden_size=32", "vision_layers=1", "vision_heads=2",
                  "hidden_size=32", "num_layers=1", "num_attention_heads=2", "seq_length=32", "vocab_size=64",
                  "image_probability=0.5"]),
    ("nemotron-moe-vlm-tiny", []),
])
def test_merge_with_host_positions_equals_megatron_cores(world, provider, settings):
    plan = prepare(RunConfig(provider=provider, provider_settings=settings,
                             training=TrainingOptions(device="cpu", micro_batch_size=3)), world_size=1)
    run = join(plan)
    model = run.build_model()
    batch = next(iter(plan.hooks.data_provider(settings=plan.settings, ctx=run.data_context())))
    if "imgs_sizes" in str(batch["modality_inputs"]):  # Nemotron: the sizes stay a host tensor
        sizes = next(iter(next(iter(batch["modality_inputs"].values())).values()))["imgs_sizes"]
        assert to_device({"imgs_sizes": sizes}, torch.device("meta"), torch.float32)["imgs_sizes"] is sizes
    rows = placeholder_rows(batch["input_ids"], model.special_token_ids, torch.device("cpu"))
    assert sum(r.numel() for r in rows.values()) > 0
    reference, reference_grads = _loss_and_grads(model, batch, None)  # megatron-core's nonzero/masked_scatter
    merged, grads = _loss_and_grads(model, batch, rows)
    assert torch.equal(merged, reference)
    assert grads.keys() == reference_grads.keys()
    unequal = [name for name in grads if not torch.equal(grads[name], reference_grads[name])]
    assert not unequal, unequal[:3]


def test_merge_refuses_a_count_mismatch_and_zeroes_missing_modalities():
    ids = torch.tensor([[5, 9, 9, 1], [9, 2, 3, 4]])  # 9: the image placeholder, samples of 4 tokens
    rows = placeholder_rows(ids, {"images": 9}, torch.device("cpu"))
    assert rows["images"].tolist() == [2, 4, 1]  # [s * b] rows, sample by sample: (0, 1), (0, 2), (1, 0)
    dense = torch.ones(4, 2, 3)
    assert merge(dense, {}, rows).view(8, 3)[[2, 4, 1]].abs().sum() == 0
    assert merge(dense, {}, rows).view(8, 3)[[0, 3]].eq(1).all()
    with pytest.raises(ValueError, match=r"Number of images tokens \(3\) does not match number of images "
                                         r"embeddings \(2\)"):
        merge(dense, {"images": torch.zeros(2, 3)}, rows)
    assert placeholder_rows(ids.to("meta"), {"images": 9}, torch.device("cpu")) is None  # on a device: not found
