"""Local (non-TE) stand-ins for the two transformer-engine pieces that megatron-core's hybrid and ViT specs use
and that have no local equivalent with the same parameter names.

* `LayerNormColumnParallelLinear`: a norm fused in front of megatron's ColumnParallelLinear with TE's parameter
  names (shared with other providers: mimo.plugins.kit.local_norms).
* `LocalHybridStack`: megatron's HybridStack builds its final norm with `TENorm` unconditionally; this one
  builds megatron's torch norm in its place (same parameter name, `final_norm.weight`).
"""

from __future__ import annotations

from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from mimo.plugins.kit.local_norms import LayerNormColumnParallelLinear

__all__ = ["LayerNormColumnParallelLinear", "LocalHybridStack"]


class LocalHybridStack(HybridStack):
    """megatron-core's HybridStack with a torch final norm instead of its hard-wired TENorm."""

    def __init__(self, config, submodules, *args, post_layer_norm: bool = True, **kwargs):
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        # HybridStack.forward applies `final_norm` when `post_process and post_layer_norm` (read at run time).
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = WrappedTorchNorm(config=config, hidden_size=config.hidden_size,
                                               eps=config.layernorm_epsilon)
