"""The chunked gated delta rule in PyTorch (the algorithm of flash-linear-attention's `chunk_gated_delta_rule`), for
the local gated delta net: within a chunk the delta rule's updates solved as one unit-triangular system
(`torch.linalg.solve_triangular`: fast forward and backward, where megatron-core's torch fallback substitutes row
by row in Python), across chunks the recurrent state carried."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           chunk: int = CHUNK, state: torch.Tensor | None = None):
    """q, k [B, S, H, dk] (L2-normalized, one per value head), v [B, S, H, dv], g (log decay, <= 0) and beta
    [B, S, H] -> the output [B, S, H, dv] in q's dtype, computed in fp32, the state starting at zero:
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T,  o_t = S_t^T q_t / sqrt(dk).
    With `state` ([B, H, dk, dv], decoding) it starts there instead, and (output, final state) is returned."""
    dtype, length, initial = q.dtype, q.shape[1], state
    chunk = min(chunk, length)  # one token (decoding): a chunk of one
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))  # heads first
    q = q * q.shape[-1] ** -0.5
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    b, h, total, dk = k.shape
    q, k, v = (x.reshape(b, h, total // chunk, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, -1, chunk).cumsum(-1), beta.reshape(b, h, -1, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [.., i, j] = e^(g_i-g_j)
    k_beta = k * beta.unsqueeze(-1)
    # (I + strictly-lower(beta k k^T decay)) u = beta v: the chunk's updates with their mutual corrections
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1) + torch.eye(chunk, device=q.device)
    values = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * g.exp().unsqueeze(-1), upper=False,
                                              unitriangular=True)
    attn = q @ k.transpose(-1, -2) * decay  # within the chunk, causal (decay is 0 above the diagonal)
    q_decayed = q * g.exp().unsqueeze(-1)
    k_to_end = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    state = q.new_zeros(b, h, dk, v.shape[-1]) if initial is None else initial.float()
    out = []
    for i in range(total // chunk):
        u = values[:, :, i] - k_decayed[:, :, i] @ state
        out.append(q_decayed[:, :, i] @ state + attn[:, :, i] @ u)
        state = state * g[:, :, i, -1, None, None].exp() + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = torch.stack(out, dim=2).reshape(b, h, total, -1)[:, :, :length].transpose(1, 2).to(dtype)
    return out if initial is None else (out, state)
