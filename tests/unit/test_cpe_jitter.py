"""RADIO's jittered position embeddings as two GEMMs give what megatron-core's grid_sample gives."""

import types

import pytest
import torch
from megatron.core.models.vision.radio import RADIOViTModel

from mimo.providers.nemotron.cpe_jitter import _tap_weights, jittered_position_embeddings


def _megatron(table, rows, cols, batch, dims, align_corners):
    """RADIOViTModel's own method on an object with the attributes it reads (training, CPE jitter on)."""
    radio = types.SimpleNamespace(
        max_num_rows=rows, max_num_cols=cols, position_embeddings=table, interpolate_only_cpe=False, has_cpe=True,
        training=True, force_cpe_eval_mode=False, grid_sample_align_corners=align_corners,
        interpolate_align_corners=False, cpe_aspect_ratio_select=False)
    return RADIOViTModel._get_pos_embeddings(radio, batch, dims)


@pytest.mark.parametrize("align_corners", [True, False])
@pytest.mark.parametrize("batch,dims", [(1, (5, 9)), (3, (12, 4)), (2, (16, 15)), (1, (20, 7))])
def test_values_and_gradients_match_grid_sample(batch, dims, align_corners):
    rows, cols, hidden = 16, 16, 24
    table = torch.randn(1, rows * cols, hidden, dtype=torch.float64).float().requires_grad_()
    mine_table = table.detach().clone().requires_grad_()
    torch.manual_seed(7)
    expected = _megatron(table, rows, cols, batch, dims, align_corners)
    after_theirs = torch.rand(1)  # the random stream left where megatron-core leaves it
    torch.manual_seed(7)
    got = jittered_position_embeddings(mine_table, rows, cols, batch, dims, align_corners)
    assert torch.rand(1) == after_theirs
    assert got.shape == expected.shape == (batch, dims[0] * dims[1], hidden)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    upstream = torch.randn(expected.shape)
    (expected * upstream).sum().backward()
    (got * upstream).sum().backward()
    torch.testing.assert_close(mine_table.grad, table.grad, rtol=1e-5, atol=1e-5)


def test_bf16_table_gives_bf16_in_the_same_roundings():
    table = torch.randn(1, 64, 8).bfloat16()
    torch.manual_seed(3)
    expected = _megatron(table, 8, 8, 2, (5, 7), True)
    torch.manual_seed(3)
    got = jittered_position_embeddings(table, 8, 8, 2, (5, 7), True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_taps_outside_the_table_are_zero_padding():
    weights = _tap_weights(torch.tensor([[-1.0, 1.0, -1.2, 1.8, 0.0]]), 4, align_corners=True)
    assert torch.equal(weights[0, 0], torch.tensor([1.0, 0, 0, 0]))  # exactly on the first entry
    assert torch.equal(weights[0, 1], torch.tensor([0, 0, 0, 1.0]))  # exactly on the last
    assert weights[0, 2, 0] < 1 and weights[0, 2].sum() < 1  # partly before the table: that tap is dropped
    assert weights[0, 3].sum() == 0  # wholly past it
    torch.testing.assert_close(weights[0, 4], torch.tensor([0, 0.5, 0.5, 0]))


def test_radio_in_training_uses_it_and_trains_as_megatron_cores_grid_sample_would(monkeypatch):
    from helpers import build_nemotron_encoder, world_of_one

    from mimo.providers.nemotron import TINY, NemotronVLMSettings
    from mimo.providers.nemotron.data import image_mode
    from mimo.providers.nemotron.model import RadioEncoder

    settings = NemotronVLMSettings(**{**TINY, "backend": "local", "cpe_augmentation": True})
    mode = image_mode(settings)
    gen = torch.Generator().manual_seed(0)
    images = mode.collate([mode.process(torch.rand(3, h, w, generator=gen)) for h, w in ((64, 96), (128, 64))])
    with world_of_one():
        encoder = build_nemotron_encoder(settings)
        encoder.train()
        assert not encoder.force_cpe_eval_mode
        results, samplings = [], []
        grid_sample = torch.nn.functional.grid_sample

        def counted(*args, **kwargs):
            samplings.append(use_megatrons)
            return grid_sample(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "grid_sample", counted)
        for use_megatrons in (False, True):
            if use_megatrons:  # megatron-core's own method, grid_sample
                encoder._get_pos_embeddings = types.MethodType(RADIOViTModel._get_pos_embeddings, encoder)
            encoder.zero_grad()
            torch.manual_seed(11)
            out = encoder(**images)
            out.square().sum().backward()
            results.append((out.detach(), {n: p.grad.clone() for n, p in encoder.named_parameters()}))
    assert samplings and all(samplings)  # grid_sample ran only where megatron-core's method did
    (ours, our_grads), (theirs, their_grads) = results
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, their_grads[name], rtol=1e-3, atol=1e-5, msg=name)
    assert our_grads["position_embeddings"].abs().sum() > 0
