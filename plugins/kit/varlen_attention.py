"""Packed (THD) self-attention by torch's variable-length flash-attention kernel: one launch for all sequences of a
pack, no wait for the host (the bounds stay on the GPU), capturable in a CUDA graph.

Why not transformer-engine's fused attention there: for RADIO's packed images (head dimension 80) cuDNN's backward
spends as long in its preprocessing kernel (the row sums of dO * O) as in the attention itself
(docs/benchmarks.md (g), scripts/gpu/check_radio_attention.py). `FlashVarlenAttention` is a drop-in core attention
for megatron-core's SelfAttention (the arguments of SDPAttention); where the flash kernel does not apply (a CPU
tensor, fp32, dropout while training, padded sequence starts, an unsupported head dimension) it is SDPAttention.
"""

from __future__ import annotations

import torch

from mimo.plugins.kit.attention import SDPAttention

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_varlen(query, key, value, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q: int, max_seqlen_kv: int, *,
                 causal: bool, scale: float) -> torch.Tensor:
    """[t, heads, d] attention of packed sequences (boundaries `cu_seqlens_*`, int32 on the tensors' device), with
    autograd. The aten flash op itself, not `torch.nn.attention.varlen.varlen_attn`: newer torch releases route that
    to cuDNN on Hopper, whose packed backward is what this avoids."""
    out = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seqlens_q, cu_seqlens_kv, int(max_seqlen_q), int(max_seqlen_kv), 0.0, causal, False,
        scale=scale)
    return out[0]


def flash_applies(query, key, params, dropout: float) -> bool:
    """Whether the flash kernel can run these packed sequences (else SDPAttention's loop runs them)."""
    d = query.shape[-1]  # the flash kernels take head dimensions in multiples of 8 up to 256
    return (query.is_cuda and query.dtype in _FLASH_DTYPES and key.dtype == query.dtype and dropout == 0.0
            and d % 8 == 0 and d <= 256 and query.stride(-1) == key.stride(-1) == 1
            and params.cu_seqlens_q.dtype == params.cu_seqlens_kv.dtype == torch.int32
            and params.cu_seqlens_q_padded is None and params.cu_seqlens_kv_padded is None
            and params.max_seqlen_q is not None and params.max_seqlen_kv is not None)


class FlashVarlenAttention(SDPAttention):
    """SDPAttention whose packed sequences on a GPU go through `flash_varlen`; sbhd input is SDPAttention's."""

    def _forward_thd(self, query, key, value, params, causal: bool):
        dropout = self.dropout if self.training else 0.0
        if not flash_applies(query, key, params, dropout):
            return super()._forward_thd(query, key, value, params, causal)
        out = flash_varlen(query, key, value.contiguous() if value.stride(-1) != 1 else value, params.cu_seqlens_q,
                           params.cu_seqlens_kv, params.max_seqlen_q, params.max_seqlen_kv, causal=causal,
                           scale=self.softmax_scale)
        return out.reshape(query.shape[0], -1)
