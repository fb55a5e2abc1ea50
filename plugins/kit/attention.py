"""A core-attention module for megatron-core's local (non-TE) layer specs that takes both layouts megatron-core's
attention hands it: `sbhd` ([s, b, heads, dim]) and packed `thd` ([tokens, heads, dim] with a THD PackedSeqParams).

megatron-core's local `DotProductAttention` materializes the [b, heads, s, s] score matrix (unfused softmax, memory
quadratic in the sequence), refuses packed sequences (RADIO's dynamic resolution packs all the images of a
micro-batch into one THD sequence) and allocates its scratch buffer on the GPU. torch's SDPA picks a fused kernel
(flash or memory-efficient attention on GPUs). This module has
DotProductAttention's constructor, so a layer spec can name it as `core_attention`, and runs torch's
scaled_dot_product_attention: once for sbhd, once per packed sequence for thd. It has no parameters, like TE's
DotProductAttention. Under context parallelism (sbhd, causal) it gathers keys and values over the CP group, which
megatron-core's local DotProductAttention cannot do: runs on the CPU and a local-backend GPU run can split a long
sequence (TE's ring attention is the faster path on GPUs).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)
_VARIABLE_LENGTH_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class SDPAttention(MegatronModule):
    """Drop-in for megatron.core.transformer.dot_product_attention.DotProductAttention (same arguments).

    Grouped-query attention shares key/value head `i // (heads / groups)` with query head `i`, as megatron does.
    `attention_mask` (sbhd only) is megatron's: True where a query may NOT attend a key.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if config.apply_query_key_layer_scaling or config.softmax_type != "vanilla" or config.window_size:
            raise NotImplementedError("SDPAttention supports plain softmax attention only (no query-key "
                                      "layer scaling, softmax offsets or sliding windows)")
        assert pg_collection is not None, "pg_collection must be provided for SDPAttention"
        self.layer_number, self.attn_mask_type, self.attention_type = layer_number, attn_mask_type, attention_type
        self.tp_group = pg_collection.tp  # read by MegatronModule.sharded_state_dict (no global parallel_state)
        self.cp_group = pg_collection.cp if config.context_parallel_size > 1 else None
        tp = self.tp_group.size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def _sdpa(self, q, k, v, mask, causal: bool):
        """q [b, heads, sq, d], k/v [b, groups, sk, d] -> [b, heads, sq, d]."""
        dropout = self.dropout if self.training else 0.0
        sq, sk = q.shape[-2], k.shape[-2]
        # SDPA takes a mask or is_causal, not both; and its is_causal aligns the mask top-left, wrong for queries
        # that follow cached keys (sq < sk): the causal mask here is aligned bottom-right, the last query sees all.
        if causal and (mask is not None or sq != sk):
            causal_mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            mask = causal_mask if mask is None else mask & causal_mask
            causal = False
        # Dropout draws from megatron's model-parallel RNG, as DotProductAttention's does.
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout > 0 else nullcontext()
        with rng:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                  scale=self.softmax_scale, enable_gqa=self.heads != self.groups)

    def forward(self, query, key, value, attention_mask, attn_mask_type: AttnMaskType | None = None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not support attention_bias")
        causal = (attn_mask_type or self.attn_mask_type) in _CAUSAL
        if self.cp_group is not None:
            if packed_seq_params is not None or attention_mask is not None:
                raise NotImplementedError("SDPAttention under context parallelism takes sbhd causal attention only "
                                          "(no packed sequences, no attention mask)")
            return self._forward_cp(query, key, value, causal)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._forward_thd(query, key, value, packed_seq_params, causal)
        # sbhd: [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = None if attention_mask is None else ~attention_mask.bool()
        out = self._sdpa(q, k, v, mask, causal)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)  # [s, b, n * d]

    def _forward_cp(self, query, key, value, causal: bool):
        """Context parallelism by gathering keys and values (megatron-core's `all_gather` CP kind): this rank holds
        chunks r and 2 x CP - 1 - r of the sequence (megatron-core's load-balanced split); its queries attend the
        whole gathered sequence, masked by their global positions."""
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        k, v = (_GatherSequence.apply(t, self.cp_group) for t in (key, value))
        q = query.permute(1, 2, 0, 3)
        k, v = (t.permute(1, 2, 0, 3) for t in (k, v))
        mask = None
        if causal:
            chunk = query.shape[0] // 2
            positions = torch.cat([torch.arange(chunk, device=q.device) + c * chunk for c in (rank, 2 * cp - 1 - rank)])
            mask = torch.arange(k.shape[-2], device=q.device)[None, :] <= positions[:, None]
        out = self._sdpa(q, k, v, mask, causal=False)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _forward_thd(self, query, key, value, params, causal: bool):
        """query [t, heads, d], key/value [t, groups, d]; sequence i is tokens [start_i, start_i + len_i), where
        start comes from the padded cumulative lengths when given. Tokens outside every sequence give zeros."""
        out = query.new_zeros(query.shape[0], query.shape[1] * query.shape[2])
        q_bounds, kv_bounds = _bounds_of(params)
        # Not cuDNN: it builds an execution plan per new shape, and packed images come in ever new lengths (on an
        # H100 that cost over a second of host time per iteration for nemotron-moe-vlm-mid).
        with sdpa_kernel(_VARIABLE_LENGTH_BACKENDS):
            for (qs, ql), (ks, kl) in zip(q_bounds, kv_bounds):
                if ql == 0:
                    continue
                q = query[qs:qs + ql].transpose(0, 1).unsqueeze(0)  # [1, heads, len, d]
                k = key[ks:ks + kl].transpose(0, 1).unsqueeze(0)
                v = value[ks:ks + kl].transpose(0, 1).unsqueeze(0)
                out[qs:qs + ql] = self._sdpa(q, k, v, None, causal)[0].transpose(0, 1).flatten(1)
        return out


class _GatherSequence(torch.autograd.Function):
    """[s / CP, ...] per CP rank, in megatron-core's load-balanced chunk order -> the whole [s, ...] in order.
    Backward: the gradient of the whole sequence summed over the CP ranks (each rank's queries reach every key),
    this rank's chunks of it. An all-reduce rather than a reduce-scatter: gloo has none."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group = group
        cp = group.size()
        parts = [torch.empty_like(local) for _ in range(cp)]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        chunks = [None] * (2 * cp)
        for r, part in enumerate(parts):
            chunks[r], chunks[2 * cp - 1 - r] = part.chunk(2)
        return torch.cat(chunks)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        cp, rank = group.size(), group.rank()
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=group)
        chunks = grad.chunk(2 * cp)
        return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]]), None


def _bounds_of(params) -> tuple[list, list]:
    """(query, key/value) bounds of `params`' sequences, read to the host once for all the layers that share these
    params in one forward (each read waits for the GPU), again only if a cu_seqlens tensor changed since."""
    tensors = (params.cu_seqlens_q, params.cu_seqlens_q_padded, params.cu_seqlens_kv, params.cu_seqlens_kv_padded)
    version = tuple((id(t), t._version) if t is not None else None for t in tensors)
    cached = params.__dict__.get("_sdpa_bounds")
    if cached is None or cached[0] != version:
        cached = (version, (_bounds(tensors[0], tensors[1]), _bounds(tensors[2], tensors[3])))
        params.__dict__["_sdpa_bounds"] = cached
    return cached[1]


def _bounds(cu_seqlens, cu_seqlens_padded):
    """[(start, length)] of each packed sequence, read to the host once (not once per sequence)."""
    ends = cu_seqlens.tolist()
    starts = (cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens).tolist()
    return [(starts[i], ends[i + 1] - ends[i]) for i in range(len(ends) - 1)]

