"""Local (non-TE) stand-ins for the two transformer-engine pieces that megatron-core's hybrid and ViT specs use
and that have no local equivalent with the same parameter names.

* `LayerNormColumnParallelLinear`: a norm followed by megatron's ColumnParallelLinear, with the norm's
  parameters named as in TE's `TELayerNormColumnParallelLinear` (`layer_norm_weight`, `layer_norm_bias`), so a
  local model's state dict and distributed-checkpoint keys equal a TE model's.
* `LocalHybridStack`: megatron's HybridStack builds its final norm with `TENorm` unconditionally; this one
  builds megatron's torch norm in its place (same parameter name, `final_norm.weight`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.torch_norm import WrappedTorchNorm


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """`norm(x) @ W^T (+ b)`: megatron's ColumnParallelLinear with an input norm in front, like TE's fused module.

    The norm follows the config (`normalization` LayerNorm or RMSNorm, `layernorm_epsilon`,
    `layernorm_zero_centered_gamma`). Its parameters are replicated over tensor parallelism: the norm runs on
    the full input, before ColumnParallelLinear's copy-to-TP region, whose backward all-reduces the input
    gradient, so every TP rank computes the same norm-weight gradient.
    """

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"LayerNormColumnParallelLinear supports LayerNorm and RMSNorm, not "
                             f"{config.normalization}")
        self.normalization, self.eps = config.normalization, config.layernorm_epsilon
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init(input_size, device=device, dtype=config.params_dtype))
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(
                torch.zeros(input_size, device=device, dtype=config.params_dtype))
        else:
            self.register_parameter("layer_norm_bias", None)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        # Normalize in fp32 (as TE does inside its kernel), return the input's dtype.
        if self.normalization == "RMSNorm":
            y = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), self.eps)
        else:
            y = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), self.layer_norm_bias.float(), self.eps)
        return y.to(x.dtype)

    def forward(self, input_, *args, **kwargs):
        return super().forward(self.norm(input_), *args, **kwargs)


class LocalHybridStack(HybridStack):
    """megatron-core's HybridStack with a torch final norm instead of its hard-wired TENorm."""

    def __init__(self, config, submodules, *args, post_layer_norm: bool = True, **kwargs):
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        # HybridStack.forward applies `final_norm` when `post_process and post_layer_norm` (read at run time).
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = WrappedTorchNorm(config=config, hidden_size=config.hidden_size,
                                               eps=config.layernorm_epsilon)
