"""Self-attention for one decode token with the token's position held on the device.

megatron-core's static inference context writes a new key at `sequence_len_offset` and reads the keys up to it by
slicing with host integers (attention.py, `_adjust_key_value_for_inference`): a CUDA graph captured at one step
would replay that step's slices at every later step. Here the position is a one-element tensor on the device: the
token's key and value are written at it with `index_copy_`, and the query attends to the whole cache buffer with the
keys after the position masked out. Reading the whole buffer (the prompt plus the answer's room) instead of the
keys so far costs little for one query next to the layer's projections.

The math is megatron's static path: the same query/key/value projection (with its q/k norms), keys cached without
the rotary embedding and rotated when read back with the model's own table, the core attention's softmax scale,
query heads grouped over their key/value head in megatron's order (a group's heads adjacent), the output
projection. The prompt (prefill) keeps megatron's path, which allocates the cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .patched_forward import patched_forward


def eligible(attention) -> bool:
    """Plain self-attention: no output gate, sink softmax, sliding window, multimodal rotary embedding, flash
    decode or context parallelism."""
    from megatron.core import utils
    from megatron.core.transformer.attention import SelfAttention

    config = attention.config
    cp = attention.pg_collection.cp
    return (isinstance(attention, SelfAttention) and not config.attention_output_gate
            and config.softmax_type == "vanilla" and not config.flash_decode and config.window_size is None
            and config.mrope_section is None and utils.get_pg_size(cp) == 1)


def softmax_scale(attention) -> float:
    scale = getattr(attention.core_attention, "softmax_scale", None)
    return scale if scale is not None else 1.0 / math.sqrt(attention.hidden_size_per_attention_head)


def one_token_forward(attention, megatron_forward, position: torch.Tensor):
    """Attention.forward for one token after the prompt (the prompt, and anything else, go to megatron's)."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    scale, layer = softmax_scale(attention), attention.layer_number
    rotate = dict(config=attention.config, mscale=attention._yarn_concentration_factor,
                  cp_group=attention.pg_collection.cp)

    def forward(hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, *args, **kwargs):
        if (inference_context is None or hidden_states.shape[0] != 1 or key_value_states is not None
                or inference_context.sequence_len_offset == 0 or kwargs.get("packed_seq_params") is not None):
            return megatron_forward(hidden_states, attention_mask, key_value_states, inference_context,
                                    rotary_pos_emb, *args, **kwargs)
        query, key, value = attention.get_query_key_value_tensors(hidden_states, None)  # [1, b, heads, d]
        batch, heads, groups = query.shape[1], query.shape[2], key.shape[2]
        keys, values = inference_context.key_value_memory_dict[layer]  # [S, B, groups, d]
        keys, values = keys[:, :batch], values[:, :batch]
        keys.index_copy_(0, position, key)
        values.index_copy_(0, position, value)
        if rotary_pos_emb is not None:
            q_table, k_table = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            query = apply_rotary_pos_emb(query, q_table.index_select(0, position), **rotate)
            keys = apply_rotary_pos_emb(keys, k_table[:keys.shape[0]], **rotate)
        visible = torch.arange(keys.shape[0], device=keys.device) <= position  # [S]
        q = query[0].reshape(batch, groups, heads // groups, -1)  # a key/value head's queries as its "sequence"
        out = F.scaled_dot_product_attention(q, keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3),
                                             attn_mask=visible.view(1, 1, 1, -1), scale=scale)
        return attention.linear_proj(out.reshape(1, batch, -1))

    return forward


class OneTokenAttention:
    """The self-attention layers of a model. `with active():` eligible layers take the one-token path, reading the
    token's position from `self.position` (set by `start`, advanced by whoever runs the step)."""

    def __init__(self, model, device: torch.device):
        from megatron.core.transformer.attention import Attention

        self.position = torch.zeros(1, dtype=torch.long, device=device)
        attentions = [m for m in model.modules() if isinstance(m, Attention)]
        self.layers = [(m, one_token_forward(m, m.forward, self.position)) for m in attentions
                       if eligible(m) and "forward" not in vars(m)]
        self.complete = len(self.layers) == len(attentions)  # no layer left on megatron's host-offset path

    def start(self, context, length: int) -> None:
        """After the prompt: the next token's position, and the cache's room after the prompt zeroed (unwritten
        memory may hold NaN, which a masked-out key would still carry into the weighted sum)."""
        self.position.fill_(length)
        for module, _ in self.layers:
            for memory in context.key_value_memory_dict.get(module.layer_number, ()):
                memory[length:].zero_()

    def active(self):
        return patched_forward(self.layers)
