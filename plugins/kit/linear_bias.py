"""Linear layers that add their bias inside the GEMM, for megatron-core transformer layers with biases (a ViT's).

megatron-core builds a layer's attention output projection and both MLP linears with `skip_bias_add=True`: each
returns its bias, added afterwards by an element-wise kernel that broadcasts it over every token (in the
bias-dropout-add, and before the MLP's activation). PyTorch runs such a broadcast add without vectorized memory
access, and its backward sums the gradient over the tokens in another kernel. transformer-engine's linear layers
add a bias in the GEMM's epilogue and compute its gradient in the backward GEMM when asked to (`return_bias`
False, which megatron-core's wrappers set from `skip_bias_add`); the layer then sees no bias to add.

`with_biases_in_gemm(layer_spec)` gives a megatron-core TransformerLayer spec whose `linear_proj`, `linear_fc1`
and `linear_fc2` are such subclasses: same parameters and names, the same values up to where the bias is rounded
(in the GEMM's fp32 accumulator rather than after the bf16 output).
"""

from __future__ import annotations

import dataclasses
from functools import partial

_classes: dict[type, type] = {}


def bias_in_gemm(linear: type) -> type:
    """A subclass of megatron-core linear layer class `linear` built with `skip_bias_add=False` whatever its module
    asks: its forward returns (output with the bias added, None)."""
    if linear not in _classes:
        def __init__(self, *args, skip_bias_add: bool = False, **kwargs):
            linear.__init__(self, *args, skip_bias_add=False, **kwargs)

        _classes[linear] = type(f"{linear.__name__}BiasInGemm", (linear,), {
            "__init__": __init__, "__module__": __name__,
            "__doc__": f"{linear.__name__} adding its bias in the GEMM (mimo.plugins.kit.linear_bias)."})
    return _classes[linear]


def with_biases_in_gemm(layer_spec):
    """A TransformerLayer spec whose attention output projection and MLP linears add their biases in the GEMM.
    The MLP may be a ModuleSpec or a partial (megatron-core's `MLP.as_mlp_submodule`)."""
    layer = layer_spec.submodules
    attention = layer.self_attention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, linear_proj=bias_in_gemm(attention.submodules.linear_proj)))
    mlp = layer.mlp
    submodules = mlp.keywords["submodules"] if isinstance(mlp, partial) else mlp.submodules
    submodules = dataclasses.replace(submodules, linear_fc1=bias_in_gemm(submodules.linear_fc1),
                                     linear_fc2=bias_in_gemm(submodules.linear_fc2))
    if isinstance(mlp, partial):
        mlp = partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    else:
        mlp = dataclasses.replace(mlp, submodules=submodules)
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer, self_attention=attention, mlp=mlp))
