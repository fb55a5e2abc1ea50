"""megatron-core's sequence-level MoE auxiliary loss (`seq_aux_loss`) per packed sample.

megatron-core balances the experts within each sequence: a sequence s of n_s tokens gives
`coeff * E / (topk * n_s^2) * sum_e P_se * T_se` (P: its tokens' router scores for the auxiliary loss summed per
expert, T: its tokens routed to each expert), and a micro-batch the mean of its sequences' (the rows of `[S, B]`).
A packed (THD) micro-batch is one flattened row holding several samples of different lengths; megatron-core's MoE
layers can restore its rows (`PackedSeqParams.tokens_per_sample`), which balances each row, its samples and
padding together. Here each packed sample is a sequence of its own and its padding is left out: a packed
micro-batch's loss is the mean of what each of its samples gives run alone, one sample a row (unpacked rows of one
length give the same; megatron-core's padded rows under a `padding_mask` divide each row by the mean row length
instead of its own).

* `PerSampleSeqAuxRouter`: megatron-core's `TopKRouter` whose sequence-level loss is per sample when it is handed
  the samples of its tokens (`TokenSamples`), else megatron-core's own. Under tensor (sequence) and context
  parallelism each rank holds part of a sample: the tokens routed per sample and expert are summed over the
  router's TP x CP group and each rank adds its tokens' share, as megatron-core's loss does; the gradient goes
  through megatron-core's `attach_and_log_load_balancing_loss`, with the rank's real (non-padding) tokens as the
  valid token count, and the logged `seq_load_balancing_loss` is this loss.
* `PerSampleMoELayer`: megatron-core's `MoETransformerLayer` that, training on a packed micro-batch, reads the
  samples from the `packed_seq_params` of its forward (`local_token_samples`: the rank's share under context and
  sequence parallelism) and hands them to its router for the length of its MLP's forward, which a full-layer
  recompute runs again with the same `packed_seq_params`. The MLP's own recompute (megatron-core's `mlp` or `moe`
  recompute modules) would run the router again after that forward, without them: refused.
* `with_per_sample_seq_aux_loss(spec)`: a MoE transformer-layer spec with both.

A packed sample is what `cu_seqlens_q_padded` (its place in the flattened rows; `cu_seqlens_q` without it) says;
its first `cu_seqlens_q[i + 1] - cu_seqlens_q[i]` tokens are real, the rest of its place padding. Where a packing
describes its samples by their padded places (mimo's under context parallelism, data/task_encoder.py), that padding
counts as the sample's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_layer import MoETransformerLayer

from mimo.errors import UsageError


@dataclasses.dataclass
class TokenSamples:
    """The packed sample of each of a rank's tokens: `ids[t]` in `[0, count)`, or `count` for padding."""

    ids: torch.Tensor  # [tokens] int64
    count: int  # the micro-batch's samples (packed sequences), all ranks alike


def local_token_samples(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None, tokens: int, *,
                        cp_size: int = 1, cp_rank: int = 0, sp_size: int = 1, sp_rank: int = 0) -> TokenSamples:
    """The samples of the `tokens` a rank holds of a packed micro-batch, on the boundaries' device and without
    waiting for it. Context parallelism (transformer-engine's `thd_get_partitioned_indices`) cuts each place into
    2 x CP equal chunks and CP rank r keeps chunks r and 2 x CP - 1 - r, place after place; sequence parallelism
    then cuts the CP rank's tokens into `sp_size` consecutive shares."""
    places = (cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens).to(torch.int64)
    count = places.numel() - 1
    if cu_seqlens.numel() != places.numel():
        raise ValueError(f"cu_seqlens_q has {cu_seqlens.numel()} entries, cu_seqlens_q_padded {places.numel()}")
    lengths = cu_seqlens[1:].to(torch.int64) - cu_seqlens[:-1].to(torch.int64)
    local = torch.arange(tokens, device=places.device) + sp_rank * tokens  # in the CP rank's stream
    if cp_size > 1:
        shares = places // cp_size  # each place's tokens on one CP rank
        sample = torch.searchsorted(shares[1:], local, right=True).clamp(max=count - 1)
        offset = local - shares[sample]
        half = (shares[sample + 1] - shares[sample]) // 2
        second = offset >= half
        chunk = torch.where(second, 2 * cp_size - 1 - cp_rank, cp_rank)
        position = places[sample] + chunk * half + offset - torch.where(second, half, 0)
        inside = local < shares[-1]
    else:
        position = local
        sample = torch.searchsorted(places[1:], position, right=True).clamp(max=count - 1)
        inside = position < places[-1]
    real = inside & (position - places[sample] < lengths[sample])
    return TokenSamples(ids=torch.where(real, sample, count), count=count)


def per_sample_seq_aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, samples: TokenSamples, *, topk: int,
                            coeff: float, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's share of the mean over samples of megatron-core's sequence-level loss, this rank's real
    tokens). `scores`, `routing_map`: `[tokens, experts]`, the router's scores and choices for the auxiliary loss;
    `group`: the router's TP x CP group, over which the shares add up to the loss."""
    experts, padding = scores.shape[-1], samples.count
    bins = (samples.count + 1, experts)  # one per sample, and one for the padding
    # index_add on a GPU adds in no fixed order, as megatron-core's token permutation does: both are fixed by
    # torch.use_deterministic_algorithms
    routed = scores.new_zeros(bins).index_add_(0, samples.ids, routing_map.to(scores.dtype))
    routed = reduce_from_tensor_model_parallel_region(routed, group)[:padding]  # T: every rank's tokens
    summed = scores.new_zeros(bins).index_add(0, samples.ids, scores)[:padding]  # P: this rank's tokens
    tokens = routed.sum(-1) / topk  # n_s
    present = tokens > 0  # a sample without real tokens (an empty row) is no sequence
    n = torch.where(present, tokens, torch.ones_like(tokens))
    per_sample = (summed * routed).sum(-1) * (experts * coeff / topk) / (n * n)
    loss = per_sample.sum() / present.sum().clamp(min=1)
    return loss, (samples.ids < padding).sum()


class PerSampleSeqAuxRouter(TopKRouter):
    """TopKRouter whose `seq_aux_loss` is per packed sample for a forward handed `token_samples` (set by
    `PerSampleMoELayer` around its MLP's forward); megatron-core's own otherwise."""

    token_samples: TokenSamples | None = None

    def balances_sequences(self) -> bool:
        return self.get_aux_loss_coeff("seq_aux_loss") > 0

    def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz,
                            with_padding_mask=False):
        samples, coeff = self.token_samples, self.get_aux_loss_coeff("seq_aux_loss")
        if samples is None or coeff == 0:
            return super()._apply_seq_aux_loss(probs, scores_for_aux_loss, routing_map, seq_length, bsz,
                                               with_padding_mask=with_padding_mask)
        if samples.ids.numel() != scores_for_aux_loss.shape[0]:
            raise ValueError(f"the router has {scores_for_aux_loss.shape[0]} tokens, their samples "
                             f"{samples.ids.numel()}")
        loss, real_tokens = per_sample_seq_aux_loss(scores_for_aux_loss, routing_map, samples, topk=self.topk,
                                                    coeff=coeff, group=self.tp_cp_group)
        return self.attach_and_log_load_balancing_loss(probs, coeff, loss, "seq_load_balancing_loss",
                                                       self.tp_cp_group, valid_token_count=real_tokens)


def _packed(params) -> bool:
    return (params is not None and getattr(params, "qkv_format", None) == "thd"
            and getattr(params, "cu_seqlens_q", None) is not None)


class PerSampleMoELayer(MoETransformerLayer):
    """MoETransformerLayer whose router balances each packed sample of a training micro-batch
    (`PerSampleSeqAuxRouter`); its tokens stay in their flattened order (megatron-core's restored rows are not
    needed). Anything else is megatron-core's forward, unchanged."""

    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None, packed_seq_params=None):
        router = getattr(self.mlp, "router", None)
        if not (isinstance(router, PerSampleSeqAuxRouter) and router.balances_sequences() and self.training
                and inference_context is None and _packed(packed_seq_params) and hidden_states.shape[1] == 1):
            return super()._forward_mlp(hidden_states, inference_context, padding_mask=padding_mask,
                                        packed_seq_params=packed_seq_params)
        if self.recompute_mlp or getattr(self.mlp, "moe_layer_recompute", False):
            raise UsageError("the per-sample MoE auxiliary loss of packed micro-batches does not work with "
                             "megatron-core's 'mlp' or 'moe' recompute modules (they run the router again "
                             "outside the layer's forward); recompute whole layers or other modules")
        flat = copy.copy(packed_seq_params)  # shallow: the same tensors, no recomputed seq_idx
        flat.tokens_per_sample = None
        router.token_samples = self.samples_of(hidden_states.shape[0], packed_seq_params)
        try:
            return super()._forward_mlp(hidden_states, inference_context, padding_mask=padding_mask,
                                        packed_seq_params=flat)
        finally:
            router.token_samples = None

    def samples_of(self, tokens: int, params) -> TokenSamples:
        """The samples of this rank's `tokens` of the micro-batch `params` describes: found once per micro-batch
        and kept on `params`, which every MoE layer of the micro-batch (and a recompute) is handed."""
        kept = getattr(params, "_mimo_token_samples", None)
        if kept is not None and kept.ids.numel() == tokens:
            return kept
        cp, tp = getattr(self.pg_collection, "cp", None), getattr(self.pg_collection, "tp", None)
        cp_size, cp_rank = (cp.size(), cp.rank()) if cp is not None else (1, 0)
        sp = self.config.sequence_parallel and tp is not None and tp.size() > 1
        samples = local_token_samples(params.cu_seqlens_q, params.cu_seqlens_q_padded, tokens, cp_size=cp_size,
                                      cp_rank=cp_rank, sp_size=tp.size() if sp else 1,
                                      sp_rank=tp.rank() if sp else 0)
        params._mimo_token_samples = samples
        return samples


def with_per_sample_seq_aux_loss(moe_layer_spec):
    """A megatron-core MoE transformer-layer spec (`MoETransformerLayer`, its `mlp` a partial whose `submodules`
    are `MoESubmodules` with megatron-core's `TopKRouter`) with `PerSampleMoELayer` and `PerSampleSeqAuxRouter`; a
    spec without MoE submodules (a dense layer) comes back unchanged."""
    mlp = getattr(getattr(moe_layer_spec, "submodules", None), "mlp", None)
    submodules = mlp.keywords.get("submodules") if isinstance(mlp, functools.partial) else None
    if not isinstance(submodules, MoESubmodules):
        return moe_layer_spec
    if moe_layer_spec.module is not MoETransformerLayer or submodules.router is not TopKRouter:
        raise TypeError(f"with_per_sample_seq_aux_loss: a layer {moe_layer_spec.module.__name__} with router "
                        f"{getattr(submodules.router, '__name__', submodules.router)}; it replaces megatron-core's "
                        f"MoETransformerLayer and TopKRouter")
    router = dataclasses.replace(submodules, router=PerSampleSeqAuxRouter)
    mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": router})
    return dataclasses.replace(moe_layer_spec, module=PerSampleMoELayer,
                               submodules=dataclasses.replace(moe_layer_spec.submodules, mlp=mlp))
