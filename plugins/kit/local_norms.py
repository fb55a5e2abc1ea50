"""Local (non-TE) norms with transformer-engine's parameter names and numerics, for providers' local layer specs.

* `LayerNormColumnParallelLinear`: a norm followed by megatron's ColumnParallelLinear, with the norm's parameters
  named as in TE's `TELayerNormColumnParallelLinear` (`layer_norm_weight`, `layer_norm_bias`), so a local model's
  state dict and distributed-checkpoint keys equal a TE model's.
* `RMSNorm`: megatron-core's `WrappedTorchNorm` refuses `layernorm_zero_centered_gamma` (weights stored as
  `w - 1`, applied as `1 + w`: Qwen's and Gemma's norms); this one follows the config like `TENorm`, or the
  `zero_centered_gamma` it is given, with TE's parameter name (`weight`).

Both normalize in fp32 (as TE does inside its kernels) and return the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear


def _weight_init(config, size: int, zero_centered: bool) -> torch.nn.Parameter:
    device = None if config.use_cpu_initialization else torch.cuda.current_device()
    init = torch.zeros if zero_centered else torch.ones
    return torch.nn.Parameter(init(size, device=device, dtype=config.params_dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    scale = weight.float() + 1 if zero_centered else weight.float()
    return F.rms_norm(x.float(), (x.shape[-1],), scale, eps).to(x.dtype)


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension; `zero_centered_gamma` None follows the config's
    `layernorm_zero_centered_gamma`. Built as megatron-core builds norms: `(config=, hidden_size=, eps=)`."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, zero_centered_gamma: bool | None = None):
        super().__init__()
        self.eps = eps
        self.zero_centered = (config.layernorm_zero_centered_gamma if zero_centered_gamma is None
                              else zero_centered_gamma)
        self.weight = _weight_init(config, hidden_size, self.zero_centered)
        # replicated over TP; under sequence parallelism its gradient is all-reduced like TENorm's
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered)


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
        self.layer_norm_weight = _weight_init(config, input_size, self.zero_centered_gamma)
        if self.normalization == "LayerNorm":
            device = None if config.use_cpu_initialization else torch.cuda.current_device()
            self.layer_norm_bias = torch.nn.Parameter(
                torch.zeros(input_size, device=device, dtype=config.params_dtype))
        else:
            self.register_parameter("layer_norm_bias", None)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalization == "RMSNorm":
            return rms_norm(x, self.layer_norm_weight, self.eps, self.zero_centered_gamma)
        weight = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        y = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), self.layer_norm_bias.float(), self.eps)
        return y.to(x.dtype)

    def forward(self, input_, *args, **kwargs):
        return super().forward(self.norm(input_), *args, **kwargs)
