"""Decoding state for `LocalMambaMixer`: what megatron-core's static inference context keeps per Mamba layer, laid out
as megatron-core's `MambaMixer` lays it out, so the local and te backends hold and continue the same state:

    inference_context.key_value_memory_dict[layer_number] = (conv_state [b, conv channels, d_conv],  pre-conv xBC
                                                             ssm_state  [b, heads, head dim, d_state])

The prompt (the context's `sequence_len_offset` is 0) runs the training scan and leaves the last `d_conv` pre-conv
columns and the scan's final state behind; each later call takes one token: the convolution window moves by one
column and the recurrence takes one step, `h = exp(dt A) h + dt B x`, `y = C h + D x`. The step size is clamped by
`dt_limit` exactly as in the scan, so a decoded token equals the one a recomputation of the whole sequence gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cached_states(mixer, ctx, batch: int, packed_seq_params=None) -> tuple[torch.Tensor, torch.Tensor]:
    """This layer's (conv_state, ssm_state) in `ctx`, allocated once, zeroed at a new prompt (MambaMixer's
    `_get_states_from_cache`). Static batching only, no packed sequences, no sequence parallelism."""
    if not ctx.is_static_batching() or packed_seq_params is not None or mixer.config.sequence_parallel:
        raise NotImplementedError("LocalMambaMixer decodes with a static inference context only (no dynamic "
                                  "batching, packed sequences or sequence parallelism)")
    memory = ctx.key_value_memory_dict
    states = memory.get(mixer.layer_number)
    if states is None or states[0].shape[0] != batch:
        conv_channels = mixer.d_inner_local_tp + 2 * mixer.ngroups_local_tp * mixer.d_state
        conv = torch.zeros(batch, conv_channels, mixer.d_conv, device=mixer.conv1d_weight.device,
                           dtype=mixer.conv1d_weight.dtype)
        ssm = torch.zeros(batch, mixer.nheads_local_tp, mixer.headdim, mixer.d_state,
                          device=mixer.in_proj.weight.device, dtype=mixer.in_proj.weight.dtype)
        memory[mixer.layer_number] = states = (conv, ssm)
    elif ctx.sequence_len_offset == 0:
        for state in states:
            state.zero_()
    return states


def keep_conv_window(conv_state: torch.Tensor, xBC: torch.Tensor) -> None:
    """After the prompt: its last `d_conv` pre-conv columns (xBC [l, b, channels]), left zero-padded."""
    window = xBC.permute(1, 2, 0)[..., -conv_state.shape[-1]:]
    conv_state.copy_(F.pad(window, (conv_state.shape[-1] - window.shape[-1], 0)))


def decode_step(mixer, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor):
    """One token (hidden_states [1, b, d_model]) -> (out [1, b, d_model], out_bias); updates both states in place.
    Computed in fp32, stored in the states' dtypes."""
    if hidden_states.shape[0] != 1:
        raise NotImplementedError(f"LocalMambaMixer decodes one token at a time, got {hidden_states.shape[0]}")
    zxBCdt, _ = mixer.in_proj(hidden_states)
    h, p, g, n = mixer.nheads_local_tp, mixer.headdim, mixer.ngroups_local_tp, mixer.d_state
    z, xBC, dt = torch.split(zxBCdt[0], [mixer.d_inner_local_tp, mixer.d_inner_local_tp + 2 * g * n, h], dim=-1)
    conv_state.copy_(torch.roll(conv_state, -1, -1))
    conv_state[:, :, -1] = xBC
    xBC = F.silu((conv_state.float() * mixer.conv1d_weight[:, 0].float()).sum(-1) + mixer.conv1d_bias.float())
    x, B, C = torch.split(xBC, [mixer.d_inner_local_tp, g * n, g * n], dim=-1)
    x = x.view(-1, h, p)
    # heads sharing a group are consecutive: group i serves heads i*r .. i*r + r - 1
    B, C = (t.view(-1, g, 1, n).expand(-1, g, h // g, n).reshape(-1, h, n) for t in (B, C))
    dt = mixer.step_size(dt)  # [b, h]
    A = -torch.exp(mixer.A_log.float())
    state = ssm_state.float() * torch.exp(dt * A)[..., None, None] + (dt[..., None] * x)[..., None] * B[:, :, None]
    ssm_state.copy_(state)
    y = torch.einsum("bhpn,bhn->bhp", state, C)
    D = mixer.D.float()
    y = (y + x * (D.view(h, 1) if D.numel() == h else D.view(h, p))).reshape(1, -1, h * p)
    y = mixer.norm(y, z[None]) if mixer.rmsnorm else y * F.silu(z[None].float())
    return mixer.out_proj(y.to(hidden_states.dtype))
