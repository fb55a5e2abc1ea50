"""Where Qwen3.5 needs more than megatron-core's modules give, as the smallest subclasses that keep megatron-core's
parameters and checkpoint keys.

* `InterleavedMRoPE`: megatron-core's MultimodalRotaryEmbedding lays the temporal, height and width frequencies out
  in contiguous sections (Qwen2-VL); Qwen3.5 interleaves them (T H W T H W ..., the last section's leftover
  frequencies temporal). Text positions ([B, S], every axis alike) or 3-D ones ([3, B, S], from image grids).
* `HeadNorm`, `Qwen35GatedDeltaNet`: the gated delta net's output norm normalizes each value head with one weight
  the TP ranks share while each holds other heads, so its gradient is a sum over them; megatron-core's
  GatedDeltaNet leaves it unsummed without sequence parallelism (the ranks' copies drift apart). The norm sums it
  in its backward and multiplies by `w` (Qwen's RMSNormGated), not by megatron-core's `1 + w`. The layer's weights
  are drawn whole and sliced per TP rank, so they start alike in every layout.
* `LocalGatedDeltaNet`: megatron-core's GatedDeltaNet refuses to be built without flash-linear-attention and runs
  its kernels in the forward; this one runs the same function in PyTorch (the causal convolution, the chunked
  gated delta rule of delta_rule.py), on any device, packed (THD) sequences one after another.
* `MRoPEAttentionLayer`: megatron-core's TransformerLayer for the full attention layers, whose CUDA graph
  (--cuda-graphs, graphs.py) takes the rotary frequencies as an input: megatron-core gives a captured layer
  frequencies only for plain RoPE, and transformer-engine's graphs drop any other argument at replay, so a
  captured multimodal-RoPE layer would rotate by nothing.
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib

import torch
import torch.nn.functional as F
from megatron.core.inference.utils import InferenceMode
from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, common as gdn_common
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.enums import CudaGraphModule
from megatron.core.transformer.transformer_layer import TransformerLayer

from mimo.errors import UsageError
from mimo.plugins.kit.local_norms import RMSNorm, rms_norm

from . import delta_decode
from .delta_rule import chunk_gated_delta_rule


class InterleavedMRoPE(MultimodalRotaryEmbedding):
    """Rotary frequencies per token from `position_ids` [B, S] (text) or [3, B, S] (temporal, height, width):
    frequency j follows the height position when j % 3 == 1 and j < 3 * sections[1], the width position when
    j % 3 == 2 and j < 3 * sections[2], the temporal one otherwise. Returns [S, B, 1, rotated dims] as megatron-core's
    rotary embeddings do (per token, so packed THD rows take it as it is).

    Decoding (`context`, a static inference context its model sets, under InferenceMode): megatron-core's attention
    rotates the cached keys of every position so far, so the frequencies of the earlier calls are kept and these
    appended."""

    context = None
    _kept = None

    def forward(self, position_ids: torch.Tensor, mrope_section, cp_group=None) -> torch.Tensor:
        if position_ids.dim() == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        positions = position_ids.to(device=self.inv_freq.device, dtype=torch.float32)
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = positions[..., None] * self.inv_freq  # [3, B, S, pairs]
        axis = torch.zeros(freqs.shape[-1], dtype=torch.long, device=freqs.device)
        for dim in (1, 2):
            axis[dim: 3 * mrope_section[dim]: 3] = dim
        freqs = freqs.gather(0, axis.expand(1, *freqs.shape[1:-1], -1)).squeeze(0)  # [B, S, pairs]
        emb = torch.cat((freqs, freqs), dim=-1)  # rotate-half layout: [f, f]
        emb = emb.transpose(0, 1)[:, :, None, :].contiguous()  # [S, B, 1, 2 * pairs]
        if cp_group is None:
            cp_group = self.cp_group
        if cp_group is not None and cp_group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        context = self.context
        if context is not None and InferenceMode.is_active() and context.is_static_batching():
            offset = context.sequence_len_offset
            if offset:
                emb = torch.cat([self._kept[:offset], emb])
            self._kept = emb
        return emb


class HeadNorm(RMSNorm):
    """RMSNorm of one value head (`weight` as it is, not zero-centered) whose weight gradient is summed over the
    tensor-parallel group `tp_group` (set by the gated delta net that owns it)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(config, hidden_size, eps, zero_centered_gamma=False)
        self.weight.sequence_parallel = False  # summed here, never again by megatron-core's finalize
        self.tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.tp_group is not None and self.tp_group.size() > 1:
            weight = copy_to_tensor_model_parallel_region(weight, group=self.tp_group)  # backward: all-reduce
        return rms_norm(x, weight, self.eps, False)


@functools.cache
def fla_backward_refusal() -> str | None:
    """Why flash-linear-attention will refuse the gated delta net's backward here, or None.

    fla refuses (in the first backward, with a traceback) on Hopper GPUs with Triton 3.4 to 3.7.0, whose compiler
    gives wrong gradients for its gated `chunk_bwd_dqkwg` kernel, unless its tilelang backend can run. The same
    condition, read from fla's own flags, is said in one line at the first training forward; decoding and
    evaluation (forward only) are unaffected."""
    import fla.utils as fla_utils
    import triton

    broken = (getattr(fla_utils, "IS_NVIDIA_HOPPER", False) and getattr(fla_utils, "TRITON_ABOVE_3_4_0", False)
              and not getattr(fla_utils, "TRITON_ABOVE_3_7_1", True))
    if not broken:
        return None
    try:
        from fla.backends import TileLangBackend
        if TileLangBackend.can_use():
            return None
    except ImportError:
        pass
    return (f"backend 'te': flash-linear-attention refuses the gated delta net's backward on Hopper GPUs with "
            f"Triton {triton.__version__} (its compiler gives wrong gradients from 3.4 to 3.7.0): install "
            f"triton>=3.7.1, or tilelang with a CUDA compiler; or use backend=local")


class Qwen35GatedDeltaNet(GatedDeltaNet):
    """megatron-core's GatedDeltaNet whose output norm (a HeadNorm) sums its gradient over the TP group, and whose
    weights start from the same values in every layout: in_proj, the convolution, the decay and out_proj drawn whole
    (`layout_free_draw`), then this TP rank's heads of each section taken. megatron-core draws a TP rank's rows of
    in_proj as one block of the whole q k v z beta alpha stack, and the convolution per rank."""

    def __init__(self, *args, **kwargs):
        # nn.Conv1d draws its (per-rank) initial weights from the generator the module's later layers draw from:
        # rewound, so that their weights do not depend on the layout either (every weight here is redrawn below)
        generator = torch.get_rng_state()
        super().__init__(*args, **kwargs)
        torch.set_rng_state(generator)
        self.out_norm.tp_group = self.tp_group
        # the sections this rank's in_proj rows stack (as Mamba's in_proj declares them): a LoRA adapter's B is
        # saved in the same parts as the weight, so that it reshards and exports part by part
        self.in_proj.weight.partition_sizes = list(self.in_proj_split_sections)

    def forward(self, hidden_states, *args, **kwargs):
        if self.training and torch.is_grad_enabled() and (refusal := fla_backward_refusal()):
            raise UsageError(refusal)  # before fla's own refusal, a traceback in the first backward
        return super().forward(hidden_states, *args, **kwargs)

    def reset_parameters(self):
        super().reset_parameters()  # dt_bias to ones
        if not self.config.perform_initialization:
            return
        tp, rank, key = self.tp_size, self.pg_collection.tp.rank(), f"layer {self.layer_number}"
        heads = self.num_value_heads
        in_proj = [self.qk_dim, self.qk_dim, self.v_dim, self.v_dim, heads, heads]  # q k v z beta alpha
        with torch.no_grad():
            weight = layout_free_draw((sum(in_proj), self.hidden_size), f"{key} in_proj",
                                      lambda t, g: t.normal_(0.0, self.config.init_method_std, generator=g))
            self.in_proj.weight.copy_(rank_rows(weight, in_proj, tp, rank))
            bound = 1 / math.sqrt(self.conv_kernel_dim)  # nn.Conv1d's kaiming-uniform bound (fan-in: the kernel)
            bound = bound if self.conv_init is None else self.conv_init
            conv = layout_free_draw((self.conv_dim, 1, self.conv_kernel_dim), f"{key} conv1d",
                                    lambda t, g: t.uniform_(-bound, bound, generator=g))
            self.conv1d.weight.copy_(rank_rows(conv, in_proj[:3], tp, rank))
            decay = layout_free_draw((heads,), f"{key} A", lambda t, g: t.uniform_(*self.A_init_range, generator=g))
            self.A_log.copy_(rank_rows(decay.log(), [heads], tp, rank))
            std = getattr(self.config.output_layer_init_method, "keywords", {}).get("std", self.config.init_method_std)
            out = layout_free_draw((self.v_dim, self.hidden_size), f"{key} out_proj",
                                   lambda t, g: t.normal_(0.0, std, generator=g))  # transposed: its input columns
            self.out_proj.weight.copy_(rank_rows(out, [self.v_dim], tp, rank).T)


def layout_free_draw(shape, key: str, fill) -> torch.Tensor:
    """A whole (global) fp32 tensor filled by `fill(tensor, generator)` from a generator seeded by the module's
    seed (the default generator's, which every rank of the module shares) and `key`: the same values whatever the
    parallel layout, pipeline stage or construction order."""
    seed = (torch.initial_seed() * 1_000_003 + zlib.crc32(key.encode())) % (1 << 63)
    return fill(torch.empty(shape), torch.Generator().manual_seed(seed))


def rank_rows(tensor: torch.Tensor, sections: list[int], tp: int, rank: int) -> torch.Tensor:
    """This TP rank's rows of a column-parallel weight whose rows are `sections` each split over TP (megatron's
    layout: every rank holds its share of each section, one after another)."""
    return torch.cat([part.chunk(tp)[rank] for part in tensor.split(sections)])


@contextlib.contextmanager
def _without_fla_check():
    """_GDNBase.__init__ raises ImportError when flash-linear-attention is missing; only its forward needs it."""
    before = gdn_common.HAVE_FLA
    gdn_common.HAVE_FLA = True
    try:
        yield
    finally:
        gdn_common.HAVE_FLA = before


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """flash-linear-attention's (and transformers') l2norm, in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class LocalGatedDeltaNet(Qwen35GatedDeltaNet):
    """megatron-core's GatedDeltaNet (same parameters, same names) computed in PyTorch. Tensor parallelism as
    megatron-core's (heads split over TP); no context parallelism. Decodes with an inference context, which
    megatron-core's module does not."""

    def __init__(self, *args, **kwargs):
        with _without_fla_check():
            super().__init__(*args, **kwargs)
        if self.cp_size > 1:
            raise ValueError("the local gated delta net has no context parallelism: --llm-cp 1, or backend te")

    def _setup_variant_attrs(self):
        super()._setup_variant_attrs()
        self.gated_delta_rule = chunk_gated_delta_rule  # flash-linear-attention's kernel otherwise

    def forward(self, hidden_states, attention_mask=None, inference_context=None, packed_seq_params=None,
                sequence_len_offset=None, *, inference_params=None, **kwargs):
        """As megatron-core's. Under megatron-core's InferenceMode with a static inference context (a context alone
        changes nothing, as for its Mamba layers) the prompt leaves its convolution columns and rule state in the
        context and later calls continue from them (delta_decode.py)."""
        context = inference_context if inference_context is not None else inference_params
        seq_len, batch, _ = hidden_states.shape
        qkvzba, _ = self.in_proj(hidden_states)  # [s, b, local q k v z beta alpha]
        qkvzba = qkvzba.transpose(0, 1)  # [b, s, ...]
        if context is not None and InferenceMode.is_active():
            out, gate = self._mix(qkvzba, delta_decode.cached_state(self, context, batch, packed_seq_params))
        elif packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # packed samples are independent sequences: each starts with an empty state and convolution window
            bounds = packed_seq_params.cu_seqlens_q_padded
            bounds = packed_seq_params.cu_seqlens_q if bounds is None else bounds
            lengths = torch.diff(bounds.cpu()).tolist()
            padding = seq_len - sum(lengths)
            mixed = [self._mix(part) for part in qkvzba.split(lengths + ([padding] if padding else []), dim=1)]
            out, gate = (torch.cat(parts, dim=1) for parts in zip(*mixed))
        else:
            out, gate = self._mix(qkvzba)
        norm_out = self._gated_norm_and_a2a(out, gate, None, batch, seq_len, packed_seq_params)
        return self.out_proj(norm_out)

    def _mix(self, qkvzba: torch.Tensor, state=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One run of independent sequences [b, s, in_proj out] -> the gated delta rule's output and the output
        gate (z), both [b, s, heads, dv]; from and into a decoding `state` (delta_decode.DeltaNetState) if given."""
        batch, seq_len = qkvzba.shape[:2]
        qkv, gate, beta, alpha = torch.split(qkvzba, self.feat_dim_split, dim=-1)
        if state is not None:
            conv = state.convolve(qkv.transpose(1, 2), self.conv1d)
        else:
            conv = F.conv1d(qkv.transpose(1, 2), self.conv1d.weight, self.conv1d.bias,
                            padding=self.conv_kernel_dim - 1, groups=self.conv_dim_local_tp)[..., :seq_len]
        qkv = self.act_fn(conv).transpose(1, 2)
        query, key, value = torch.split(qkv, [self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp], -1)
        query = query.reshape(batch, seq_len, -1, self.key_head_dim)
        key = key.reshape(batch, seq_len, -1, self.key_head_dim)
        value = value.reshape(batch, seq_len, -1, self.value_head_dim)
        if self.use_qk_l2norm:
            query, key = l2_normalized(query), l2_normalized(key)
        repeat = self.num_value_heads // self.num_key_heads
        if repeat > 1:  # each query/key head serves `repeat` consecutive value heads
            query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
        g, beta = self._compute_g_and_beta(self.A_log, self.dt_bias, alpha, beta)
        if state is not None:
            out, final = self.gated_delta_rule(query, key, value, g, beta, state=state.rule)
            state.rule.copy_(final)
        else:
            out = self.gated_delta_rule(query, key, value, g, beta)
        return out.to(qkv.dtype), gate.reshape(batch, seq_len, -1, self.value_head_dim)


class MRoPEAttentionLayer(TransformerLayer):
    """megatron-core's TransformerLayer whose captured attention reads the rotary frequencies [S, B, 1, dims] of
    each micro-batch (3-D image positions differ per sample) from a static input the graph copies them into. Their
    layout is the one the eager iterations before capture saw (the loop runs one; the shapes are fixed)."""

    rotary_layout: tuple[torch.Size, torch.dtype] | None = None

    def forward(self, *args, **kwargs):
        rotary = kwargs.get("rotary_pos_emb")
        if isinstance(rotary, torch.Tensor):
            self.rotary_layout = (rotary.shape, rotary.dtype)
        return super().forward(*args, **kwargs)

    def get_layer_static_inputs(self, seq_length, micro_batch_size):
        inputs = super().get_layer_static_inputs(seq_length, micro_batch_size)
        rotary = self.static_rotary(inputs["hidden_states"].device)
        if rotary is not None:
            inputs["rotary_pos_emb"] = rotary
        return inputs

    def static_rotary(self, device) -> torch.Tensor | None:
        """The rotary frequencies' static input where the attention is captured (zeros: replay copies the real
        ones in), else None."""
        modules = self.config.cuda_graph_modules
        if modules and CudaGraphModule.attn not in modules:
            return None
        if self.rotary_layout is None:
            raise RuntimeError(f"layer {self.layer_number}: CUDA graph capture before an eager forward gave its "
                               f"rotary frequencies' shape (the loop runs one iteration eagerly first)")
        shape, dtype = self.rotary_layout
        return torch.zeros(shape, dtype=dtype, device=device)
