"""transformer-engine's fused cross-entropy, writing the logits' gradient into the logits themselves.

megatron-core's language models call transformer-engine's `parallel_cross_entropy` with its default, which keeps
the input intact: the forward kernel writes a whole copy of the logits for the backward (on a 131k vocabulary at
8192 tokens, 2 GiB written and held per micro-batch; on an H100 the slice's forward kernels took 11.7 ms an
iteration with it, 7.0 without). Nothing reads the logits after the loss: the output layer's backward needs its
input and weight, not its output. So the copy only costs, and transformer-engine's `overwrite_input=True` computes
the same loss and gradient from the logits' own buffer. Autograd still guards it: the backward bumps the buffer's version, so
anything that did keep the logits for its backward fails loudly instead of reading gradients.

`InPlaceCrossEntropy` goes first in a megatron-core language model's bases (GPTModel, HybridModel); it changes
nothing but that argument, and falls back to megatron-core's loss wherever transformer-engine's fused
cross-entropy is not the configured one, the installed version has no such argument, or the logits are not
contiguous."""

from __future__ import annotations

import functools
import inspect

import torch


@functools.cache
def _in_place_cross_entropy():
    """transformer-engine's `parallel_cross_entropy` where it takes `overwrite_input`, else None."""
    try:
        from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy
    except ImportError:
        return None
    return parallel_cross_entropy if "overwrite_input" in inspect.signature(parallel_cross_entropy).parameters \
        else None


class InPlaceCrossEntropy:
    """Mixin for megatron-core language models: `compute_language_model_loss` without the logits' copy."""

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        config = self.config
        fused_te = config.cross_entropy_loss_fusion and config.cross_entropy_fusion_impl == "te"
        cross_entropy = _in_place_cross_entropy() if fused_te else None
        if cross_entropy is None or not logits.is_contiguous():
            return super().compute_language_model_loss(labels, logits)
        labels = labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b], as the logits
        loss = cross_entropy(logits, labels, 0.0, False, self.pg_collection.tp, -100, overwrite_input=True)
        return loss.transpose(0, 1).contiguous()  # [s, b] -> [b, s]
