"""Biases added inside the linear layers' GEMMs (mimo.plugins.kit.linear_bias, Nemotron's `vision_bias_in_gemm`):
the spec's linears become subclasses that never return their bias, and RADIO computes the same values and
gradients as with megatron-core's separate bias adds."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from helpers import build_nemotron_encoder, world_of_one

from mimo.plugins.kit.linear_bias import bias_in_gemm, with_biases_in_gemm
from mimo.providers.nemotron import TINY, NemotronVLMSettings
from mimo.providers.nemotron.data import image_mode


def test_the_spec_swaps_the_three_linears_that_return_their_bias():
    """(On the local spec: without transformer-engine, megatron-core's TE classes are placeholders.)"""
    from megatron.core.tensor_parallel import RowParallelLinear

    from mimo.providers.nemotron import specs
    from mimo.providers.nemotron.layers import LayerNormColumnParallelLinear

    spec = specs.vit_layer_spec("local")
    swapped = specs.vit_layer_spec("local", bias_in_gemm=True)
    attention, mlp = swapped.submodules.self_attention.submodules, swapped.submodules.mlp
    assert isinstance(mlp, partial) and mlp.func == spec.submodules.mlp.func
    assert attention.linear_qkv is LayerNormColumnParallelLinear  # it adds its bias already
    assert attention.linear_proj is bias_in_gemm(RowParallelLinear)
    assert issubclass(attention.linear_proj, RowParallelLinear)
    assert mlp.keywords["submodules"].linear_fc1 is bias_in_gemm(LayerNormColumnParallelLinear)
    assert mlp.keywords["submodules"].linear_fc2 is attention.linear_proj
    assert with_biases_in_gemm(spec).submodules.self_attention.submodules.linear_proj is attention.linear_proj
    assert spec.submodules.self_attention.submodules.linear_proj is RowParallelLinear  # a copy was changed


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


def test_radio_gives_the_same_values_and_gradients(world):
    base = {**TINY, "backend": "local", "cpe_augmentation": False}
    separate = build_nemotron_encoder(NemotronVLMSettings(**base))
    in_gemm = build_nemotron_encoder(NemotronVLMSettings(**base, vision_bias_in_gemm=True))
    with torch.no_grad():  # biases far from zero, so that a bias left out would show
        for p in separate.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    in_gemm.load_state_dict(separate.state_dict())
    proj = in_gemm.decoder.layers[0].self_attention.linear_proj
    assert proj.skip_bias_add is False and type(proj).__name__.endswith("BiasInGemm")

    mode = image_mode(NemotronVLMSettings(**base))
    gen = torch.Generator().manual_seed(0)
    images = mode.collate([mode.process(torch.rand(3, h, w, generator=gen)) for h, w in ((64, 96), (128, 64))])
    outputs = []
    for encoder in (separate, in_gemm):
        out = encoder(**images)
        out.square().sum().backward()
        outputs.append(out)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    grads = {n: p.grad for n, p in separate.named_parameters()}
    for name, p in in_gemm.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-5, msg=name)
