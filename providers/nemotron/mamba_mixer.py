"""A Mamba-2 mixer in plain PyTorch, for the "local" backend.

megatron-core's `MambaMixer` refuses to build without the mamba_ssm / causal_conv1d / Triton kernels, which
are CUDA-only. `LocalMambaMixer` has the same constructor, parameters (names, shapes, dtypes, TP attributes),
state dict and forward convention, so a checkpoint of one loads into the other; the scan is the chunked SSD
("state space duality") form of the Mamba-2 paper written with einsums. It decodes with megatron-core's static
inference context, in MambaMixer's state layout (mamba_decode.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron.core.inference.utils import InferenceMode
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.utils import _split_tensor_factory
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)

from . import mamba_decode

try:  # Share the spec dataclass with megatron-core so existing specs keep working.
    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
except ImportError:  # its module imports Triton ops; a CPU-only install may lack them
    from dataclasses import dataclass

    @dataclass
    class MambaMixerSubmodules:
        in_proj: object = None
        out_proj: object = None


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = a[j+1] + ... + a[i] for i >= j, -inf above the diagonal.

    Summing masked copies (rather than subtracting two cumulative sums) keeps full precision however large
    the running sum grows; the -inf makes exp() give exact zeros for the non-causal half."""
    T = a.size(-1)
    ones = torch.ones(T, T, dtype=torch.bool, device=a.device)
    sums = a.unsqueeze(-1).expand(*a.shape, T).masked_fill(~torch.tril(ones, -1), 0).cumsum(-2)
    return sums.masked_fill(~torch.tril(ones), float("-inf"))


def ssd_scan(x, dt, A, B, C, D, chunk_size: int = 128, return_final_state: bool = False):
    """Mamba-2 SSM: h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, y_t = C_t h_t + D x_t, zero initial state.

    x [b, l, h, p]; dt [b, l, h] (already softplus'ed); A [h] (negative); B, C [b, l, g, n] with heads
    h = g * r, consecutive heads sharing a group; D [h] or [h * p]. Computed in fp32 (or fp64 if given).
    With `return_final_state`: (y, the state after the last position [b, h, p, n]), what decoding continues from."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    r, cs = h // g, chunk_size
    x_skip = x.to(dtype)
    # Zero tail padding is inert: dt = 0 means no decay and no input, and the padded outputs are dropped.
    pad = (-l) % cs
    x, dt, B, C = (F.pad(t.to(dtype), (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    c = x.shape[1] // cs
    x, B, C = x.view(b, c, cs, g, r, p), B.view(b, c, cs, g, n), C.view(b, c, cs, g, n)
    dt = dt.view(b, c, cs, h)
    xdt = x * dt.view(b, c, cs, g, r, 1)
    a = (dt * A.to(dtype)).permute(0, 3, 1, 2)  # [b, h, c, s]: log of the per-step decay, <= 0
    a_cum = a.cumsum(-1)

    # Within a chunk the scan is a masked (decayed) attention: y = (C B^T * L) (dt x).
    decay = torch.exp(_segsum(a)).view(b, g, r, c, cs, cs)
    CB = torch.einsum("bclgn,bcsgn->bcgls", C, B)
    y = torch.einsum("bcgls,bgrcls,bcsgrp->bclgrp", CB, decay, xdt)

    # The state each chunk leaves behind from its own inputs (exponents are <= 0, so no overflow).
    to_end = torch.exp(a_cum[..., -1:] - a_cum).view(b, g, r, c, cs)
    states = torch.einsum("bcsgn,bgrcs,bcsgrp->bcgrpn", B, to_end, xdt)
    # Carry states across chunks with a (c+1) x (c+1) decay matrix: one einsum instead of a Python loop.
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    carry = torch.exp(_segsum(F.pad(a_cum[..., -1], (1, 0)))).view(b, g, r, c + 1, c + 1)
    states = torch.einsum("bgrzc,bcgrpn->bzgrpn", carry, states)
    # the state entering each chunk; the last is the final state (zero tail padding leaves it as it was)
    states, final = states[:, :-1], states[:, -1]

    # What the carried-in state contributes at each position of its chunk.
    from_start = torch.exp(a_cum).view(b, g, r, c, cs)
    y = y + torch.einsum("bclgn,bcgrpn,bgrcl->bclgrp", C, states, from_start)
    y = y.reshape(b, c * cs, h, p)[:, :l]
    D = D.to(dtype)
    y = y + x_skip * (D.view(h, 1) if D.numel() == h else D.view(h, p))
    return (y, final.reshape(b, h, p, n)) if return_final_state else y


class GatedGroupRMSNorm(nn.Module):
    """RMSNorm over groups of channels with an optional SiLU gate applied first (norm_before_gate=False),
    numerically as mamba_ssm's RMSNormGated; fp32 inside, output in the input's dtype."""

    def __init__(self, hidden_size, group_size, eps=1e-5, device=None, dtype=None, tp_group=None):
        super().__init__()
        self.group_size, self.eps, self.tp_group = group_size, eps, tp_group
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x, z=None):
        y = x.float() if z is None else x.float() * F.silu(z.float())
        y = y.unflatten(-1, (-1, self.group_size))
        y = (y * torch.rsqrt(y.square().mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (y * self.weight.float()).to(x.dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])


def _tp(param, sizes=None):
    param.tensor_model_parallel, param.partition_dim = True, 0
    if sizes is not None:
        param.partition_sizes = sizes


class LocalMambaMixer(MegatronModule):
    """Drop-in for megatron.core.ssm.mamba_mixer.MambaMixer (same arguments; see its docstring), plus `dt_limit`:
    the (min, max) clamp of the step size after softplus. MambaMixer's training kernel uses (0, inf), no clamp;
    Hugging Face's NemotronH clamps at (time_step_min, inf)."""

    def __init__(self, config: TransformerConfig, submodules: MambaMixerSubmodules, d_model, d_conv=4,
                 conv_init=None, expand=2, A_init_range=(1, 16), D_has_hdim=False, rmsnorm=True,
                 norm_before_gate=False, dt_min=0.001, dt_max=0.1, dt_init="random", dt_scale=1.0,
                 dt_init_floor=1e-4, bias=False, conv_bias=True, chunk_size=128, layer_number=None,
                 pg_collection: ProcessGroupCollection = None, pp_layer_offset: int = 0, name: str | None = None,
                 dt_limit: tuple[float, float] = (0.0, float("inf"))):
        super().__init__(config)
        assert pg_collection is not None, "pg_collection must be provided for LocalMambaMixer"
        assert not bias and conv_bias and not norm_before_gate, "as in MambaMixer, only these are supported"
        if pg_collection.cp is not None and pg_collection.cp.size() > 1:
            raise NotImplementedError("LocalMambaMixer does not support context parallelism")
        self.config, self.pg_collection, self.tp_group = config, pg_collection, pg_collection.tp
        self.d_model, self.d_conv, self.conv_init, self.expand = d_model, d_conv, conv_init, expand
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, norm_before_gate
        self.chunk_size, self.layer_number, self.pp_layer_offset = chunk_size, layer_number, pp_layer_offset
        self.d_state, self.headdim, self.ngroups = config.mamba_state_dim, config.mamba_head_dim, config.mamba_num_groups
        self.activation = "silu"
        self.dt_limit = tuple(dt_limit)
        if config.mamba_num_heads is not None:
            self.nheads = config.mamba_num_heads
            self.d_inner = self.nheads * self.headdim
        else:
            self.d_inner = int(expand * d_model)
            assert self.d_inner % self.headdim == 0, "d_inner must be evenly divisible by headdim"
            self.nheads = self.d_inner // self.headdim
        tp_size = self.tp_group.size()
        assert self.nheads % tp_size == 0 and self.ngroups % tp_size == 0, "heads and groups must split over TP"
        assert self.nheads % self.ngroups == 0, "nheads must be evenly divisible by ngroups"
        self.nheads_local_tp, self.ngroups_local_tp = self.nheads // tp_size, self.ngroups // tp_size
        self.d_inner_local_tp = self.d_inner // tp_size
        # On a GPU, draw from the CUDA generator like MambaMixer, so equal seeds give equal weights.
        device = torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")
        dtype = config.params_dtype
        gn = self.ngroups_local_tp * self.d_state

        self.in_proj = build_module(
            submodules.in_proj, d_model, self.d_inner * 2 + 2 * self.ngroups * self.d_state + self.nheads,
            config=config, init_method=config.init_method, gather_output=False, bias=bias, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="fc1", tp_group=self.tp_group,
            name=(name + ".in_proj") if name is not None else None)
        # Per-rank block sizes of the packed [z, x, B, C, dt] rows, for resharding across TP sizes.
        self.in_proj.weight.partition_sizes = [self.d_inner_local_tp] * 2 + [gn] * 2 + [self.nheads_local_tp]

        conv_dim = self.d_inner_local_tp + 2 * gn  # x B C
        with get_cuda_rng_tracker().fork():
            self.conv1d_weight = nn.Parameter(torch.empty(conv_dim, 1, d_conv, device=device, dtype=dtype))
            self.conv1d_bias = nn.Parameter(torch.empty(conv_dim, device=device, dtype=dtype))
            for param in (self.conv1d_weight, self.conv1d_bias):
                _tp(param, [self.d_inner_local_tp, gn, gn])
            # The same draws in the same order as MambaMixer (it keeps nn.Conv1d's old double init).
            nn.init.kaiming_uniform_(self.conv1d_weight, a=math.sqrt(5))
            bound = 1 / math.sqrt(self.conv1d_weight.size(1) * self.conv1d_weight.size(2))
            nn.init.uniform_(self.conv1d_bias, -bound, bound)
            if config.perform_initialization:
                if conv_init is not None:
                    nn.init.uniform_(self.conv1d_weight, -conv_init, conv_init)
                else:
                    nn.init.kaiming_uniform_(self.conv1d_weight, a=math.sqrt(5))

        with get_cuda_rng_tracker().fork():
            # softplus(dt_bias) is log-uniform in [dt_min, dt_max]; dt_bias stores its softplus inverse.
            dt = torch.exp(torch.rand(self.nheads_local_tp, device=device, dtype=dtype)
                           * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=dt_init_floor)
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
            assert A_init_range[0] > 0 and A_init_range[1] >= A_init_range[0]
            A = torch.empty(self.nheads_local_tp, dtype=torch.float32, device=device)
            if config.perform_initialization:
                A = A.uniform_(*A_init_range)
            self.A_log = nn.Parameter(torch.log(A))  # fp32, as in MambaMixer
        self.D = nn.Parameter(torch.ones(self.d_inner_local_tp if D_has_hdim else self.nheads_local_tp,
                                         device=device))  # fp32
        for param in (self.dt_bias, self.A_log, self.D):
            _tp(param)
        if rmsnorm:
            self.norm = GatedGroupRMSNorm(self.d_inner_local_tp, self.d_inner_local_tp // self.ngroups_local_tp,
                                          eps=1e-5, device=device, dtype=dtype, tp_group=self.tp_group)
            _tp(self.norm.weight)
        self.out_proj = build_module(
            submodules.out_proj, self.d_inner, d_model, config=config,
            init_method=config.output_layer_init_method, bias=bias, input_is_parallel=True, skip_bias_add=True,
            is_expert=False, tp_comm_buffer_name="fc2", tp_group=self.tp_group,
            name=(name + ".out_proj") if name is not None else None)

    def forward(self, hidden_states, inference_context=None, *, inference_params=None, packed_seq_params=None):
        """hidden_states [l, b, d_model] -> (out [l, b, d_model], out_bias), like MambaMixer. With THD
        `packed_seq_params` (b == 1, sequences laid end to end) each sequence is scanned on its own. Under
        megatron-core's InferenceMode with a static inference context (as in MambaMixer, a context alone changes
        nothing), a prompt leaves its state in the context and later calls decode one token (mamba_decode.py)."""
        context = inference_context if inference_context is not None else inference_params
        states = None
        if context is not None and InferenceMode.is_active():
            states = mamba_decode.cached_states(self, context, hidden_states.shape[1], packed_seq_params)
            if context.sequence_len_offset > 0:
                return mamba_decode.decode_step(self, hidden_states, *states)
        zxBCdt, _ = self.in_proj(hidden_states)
        gn = self.ngroups_local_tp * self.d_state
        z, xBC, dt = torch.split(zxBCdt, [self.d_inner_local_tp, self.d_inner_local_tp + 2 * gn,
                                          self.nheads_local_tp], dim=-1)
        if packed_seq_params is None:
            y = self._conv_scan(xBC, dt, states)
        else:
            # The convolution and the state restart at each sequence's first token: no sequence sees another.
            lengths = _sequence_lengths(packed_seq_params, xBC.shape[0], xBC.shape[1])
            y = torch.cat([self._conv_scan(x, d) for x, d in zip(xBC.split(lengths), dt.split(lengths))])
        # Gate, then (optionally) normalize: MambaMixer's order in both of its training paths.
        y = self.norm(y, z) if self.rmsnorm else y * F.silu(z.float())
        return self.out_proj(y.to(hidden_states.dtype))

    def step_size(self, dt):
        """softplus(dt + dt_bias), clamped by `dt_limit` (fp32): the same in the scan and in a decode step."""
        dt = F.softplus(dt.float() + self.dt_bias.float())
        return dt.clamp(*self.dt_limit) if self.dt_limit != (0.0, float("inf")) else dt

    def _conv_scan(self, xBC, dt, states=None):
        """The causal convolution and the SSD scan of whole sequences: xBC [l, b, conv channels], dt [l, b, heads]
        -> y [l, b, d_inner] (fp32). `states` (decoding): the context's (conv, ssm) states, left as the sequence
        leaves them."""
        gn = self.ngroups_local_tp * self.d_state
        if states is not None:
            mamba_decode.keep_conv_window(states[0], xBC)
        # Depthwise causal conv: left padding only, so position t sees t-d_conv+1 .. t.
        xBC = F.pad(xBC.permute(1, 2, 0), (self.d_conv - 1, 0))
        xBC = F.silu(F.conv1d(xBC, self.conv1d_weight.to(xBC.dtype), self.conv1d_bias.to(xBC.dtype),
                              groups=xBC.shape[1])).transpose(1, 2)
        x, B, C = torch.split(xBC, [self.d_inner_local_tp, gn, gn], dim=-1)
        y = ssd_scan(x.unflatten(-1, (self.nheads_local_tp, self.headdim)), self.step_size(dt).transpose(0, 1),
                     -torch.exp(self.A_log.float()), B.unflatten(-1, (self.ngroups_local_tp, self.d_state)),
                     C.unflatten(-1, (self.ngroups_local_tp, self.d_state)), self.D, self.chunk_size,
                     return_final_state=states is not None)
        if states is not None:
            y, final = y
            states[1].copy_(final)
        return y.flatten(-2).transpose(0, 1)  # [l, b, d_inner]

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The same keys and per-component split as MambaMixer's (without its GTP handling)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sd = {}
        self._save_to_state_dict(sd, "", keep_vars=True)
        sd = make_sharded_tensors_for_checkpoint(
            sd, prefix, {k: 0 for k in ("A_log", "dt_bias", "D", "conv1d_weight", "conv1d_bias")}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        for child_name, module in self.named_children():
            sd.update(sharded_state_dict_default(module, f"{prefix}{child_name}.", sharded_offsets, metadata,
                                                 tp_group=self.tp_group))
        gn = self.ngroups_local_tp * self.d_state
        xBC = [self.d_inner_local_tp, gn, gn]
        sd[f"{prefix}in_proj.weight"] = _split_tensor_factory(
            sd[f"{prefix}in_proj.weight"], [self.d_inner_local_tp, *xBC, self.nheads_local_tp],
            ["z", "x", "B", "C", "dt"], 0)
        for param, key in (("conv1d_weight", "conv1d.weight"), ("conv1d_bias", "conv1d.bias")):
            sd[f"{prefix}{param}"].key = f"{prefix}{key}"  # MambaMixer's keys from when conv1d was a module
            sd[f"{prefix}{param}"] = _split_tensor_factory(sd[f"{prefix}{param}"], xBC, ["x", "B", "C"], 0)
        return sd


def _sequence_lengths(params, total: int, batch: int) -> list[int]:
    """The packed sequences' lengths in the buffer (padded boundaries when given), covering all `total` tokens."""
    if params.qkv_format != "thd" or batch != 1:
        raise ValueError(f"LocalMambaMixer reads packed sequences in THD format with batch 1, got "
                         f"{params.qkv_format} with batch {batch}")
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    bounds = cu.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:]) if end > start]
    if bounds[-1] < total:  # tokens past the last sequence: padding, scanned on their own
        lengths.append(total - bounds[-1])
    return lengths
