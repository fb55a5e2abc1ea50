"""Decoding state for the gated delta net (`LocalGatedDeltaNet`) in megatron-core's static inference context:

    inference_context.key_value_memory_dict[layer_number] = (conv_state [b, conv channels, kernel - 1],  pre-conv q k v
                                                             rule_state [b, value heads, dk, dv])          fp32

The prompt (the context's `sequence_len_offset` is 0) starts both at zero and leaves its last pre-conv columns and
the rule's final state behind; each later call continues from them: its convolution sees the kept columns before
its own, and the rule starts from the kept state. A decoded token thus equals what a recomputation of the whole
sequence gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DeltaNetState:
    """One layer's (conv_state, rule_state) tensors, continued in place."""

    def __init__(self, conv: torch.Tensor, rule: torch.Tensor):
        self.conv, self.rule = conv, rule

    def convolve(self, qkv: torch.Tensor, conv1d) -> torch.Tensor:
        """qkv [b, channels, s] -> the causal convolution over the kept columns and these; keeps the last ones."""
        window = torch.cat([self.conv.to(qkv.dtype), qkv], dim=-1)
        self.conv.copy_(window[..., -self.conv.shape[-1]:])
        # one output per new column
        return F.conv1d(window, conv1d.weight, conv1d.bias, groups=conv1d.weight.shape[0])


def cached_state(net, context, batch: int, packed_seq_params=None) -> DeltaNetState:
    """This layer's state in `context`, allocated once, zeroed at a new prompt. Static batching only, no packed
    sequences, no sequence parallelism."""
    if not context.is_static_batching() or packed_seq_params is not None or net.config.sequence_parallel:
        raise NotImplementedError("the gated delta net decodes with a static inference context only (no dynamic "
                                  "batching, packed sequences or sequence parallelism)")
    memory = context.key_value_memory_dict
    states = memory.get(net.layer_number)
    if states is None or states[0].shape[0] != batch:
        device = net.conv1d.weight.device
        conv = torch.zeros(batch, net.conv_dim_local_tp, net.conv_kernel_dim - 1, device=device)
        rule = torch.zeros(batch, net.num_v_heads_local_tp, net.key_head_dim, net.value_head_dim, device=device)
        memory[net.layer_number] = states = (conv, rule)
    elif context.sequence_len_offset == 0:
        for state in states:
            state.zero_()
    return DeltaNetState(*states)
