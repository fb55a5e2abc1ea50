"""Adapters on grouped-GEMM experts: mimo's `GroupedMMExperts` (transformer-engine's TEGroupedMLP, its expert weights
weight0..weightN of two grouped linears) and `GroupedMMSequentialMLP` (megatron-core's SequentialMLP), whose forward
runs fc1, the activation times the routing probabilities, and fc2 as torch grouped GEMMs over the tokens sorted by
expert (mimo.plugins.kit.grouped_mm_moe). Each linear's adapter term is added where a SequentialMLP expert's
adapted linear adds it (fc1's to its pre-activation output, fc2's to its output, whose input already carries the
probabilities), over the same token offsets as the base GEMM. Where FP8/FP4 keeps GroupedMMExperts on
transformer-engine's grouped linears, te_grouped_linears.py adds the same terms to those linears' outputs:

* shared: one LoRA per linear and layer (A [r, in], B [out, r]), applied to all the permuted tokens at once: two
  plain matmuls.
* per-expert: each expert's A and B stacked ([E_local, r, in], [E_local, out, r]), applied by two grouped GEMMs on
  the base GEMM's offsets. The rank is padded with zeros to the 16-byte strides grouped GEMMs need (exact).
* shared-outer: the shared half as a plain matmul over all the tokens, the experts' own halves stacked through one
  grouped GEMM (fc1: x A^T, then B_e; fc2: A_e, then B).

Where the adapters live, so that parameter names, reduction groups and checkpoint keys are the SequentialMLP
layout's (an adapter checkpoint does not depend on which experts class trained it):

* GroupedMMSequentialMLP: on its per-expert linears exactly as experts.py puts them (per-expert and shared-outer:
  each linear's `lora`; shared: the experts' `lora_linear_fc1/2`), stacked per call; its per-expert fallback
  forward then adds them too.
* GroupedMMExperts has no per-expert linears: shared adapters are its `lora_linear_fc1/2` as above; per-expert ones
  (shared-outer's too) a ModuleList `lora_linear_fc1/2` of one LoRA per local expert, saved under the keys
  SequentialMLP's expert linears give theirs (`...experts.linear_fc1.lora.a` with the global expert axis; a gated
  fc1's B in its gate and linear rows, `.lora.b.part0` / `.part1`, as apply.py's row parts split an expert
  linear's). Their state-dict names differ from SequentialMLP's as the base weights' do (weight0..N against
  local_experts.N).
  shared-outer's shared halves are the experts' `lora_outer_linear_fc1/2` with either class.

Per-expert parameters are expert parameters (reduced over expert-data-parallel), shared ones dense. Stacking the
per-expert matrices copies E r (in + out) values a call (packed back to back where they can be: no copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mimo.errors import UsageError
from mimo.plugins.kit.expert_storage import pack_contiguously
from mimo.plugins.kit.main_grad import stacked

from .lora import COLUMN, ROW, LoRA, Sharding
from .te_grouped_linears import terms_on_grouped_linears

FC = ("linear_fc1", "linear_fc2")
_STRIDE_BYTES = 16  # torch's grouped GEMM wants every stride a multiple of 16 bytes


def is_grouped(experts: torch.nn.Module) -> bool:
    """Whether `experts` is one of mimo's grouped-GEMM expert classes."""
    return callable(getattr(experts, "grouped_mm_obstacle", None))


def check_grouped(experts: torch.nn.Module, where: str) -> None:
    """UsageError unless adapters can run in these grouped experts' forward: transformer-engine's experts on mimo's
    grouped-GEMM path, or on their own GroupedLinear path where only FP8/FP4 keeps them off the grouped GEMMs
    (te_grouped_linears.py adds the terms there); not where something else does (biases, ...: the adapters are not
    checked there). mimo's SequentialMLP falls back to megatron-core's per-expert linears, which take adapters."""
    from mimo.plugins.kit.grouped_mm_moe import LOW_PRECISION

    if hasattr(experts, "local_experts") or experts.grouped_mm:
        return
    other = [what for what in experts.grouped_mm_obstacles() if what != LOW_PRECISION]
    if other:
        raise UsageError(f"--lora-targets experts: the routed experts of {where} run transformer-engine's grouped "
                         f"linears, not mimo's grouped GEMMs, because of {other[0]}, where expert adapters do not "
                         f"run; change that or leave experts out of the targets")


def holds_per_expert(experts: torch.nn.Module) -> bool:
    """Per-expert adapters held by the experts module (no per-expert linears to put them on)."""
    return not hasattr(experts, "local_experts")


def expert_sharding(experts: torch.nn.Module, fc: str) -> tuple[Sharding, torch.Tensor]:
    """One expert's linear: its sharding (no communication: the dispatcher moves the tokens) and weight."""
    from mimo.plugins.kit.grouped_mm_moe import expert_weights

    weight = expert_weights(experts)[FC.index(fc)][0]
    out_features, in_features = weight.shape
    return Sharding(COLUMN if fc == "linear_fc1" else ROW, in_features, out_features), weight


def hold_per_expert(experts: torch.nn.Module, make_lora, name: str) -> int:
    """One adapter per local expert and linear, in the ModuleLists `lora_linear_fc1/2`; `make_lora(sharding,
    weight, name)` builds one (for the experts module, whose config says whether fc1 is gated: a gated fc1's B is
    then saved in gate and linear parts, as on an expert's own linear). Returns how many."""
    offset = experts.ep_group.rank() * experts.num_local_experts
    for fc in FC:
        sharding, weight = expert_sharding(experts, fc)
        loras = torch.nn.ModuleList(make_lora(sharding, weight, f"{name}.{offset + i}.{fc}")
                                    for i in range(experts.num_local_experts))
        pack(list(loras))
        experts.add_module(f"lora_{fc}", loras)
    return experts.num_local_experts * len(FC)


def pack(loras: list[LoRA]) -> None:
    """The experts' A and B each back to back in one tensor: the grouped GEMMs take them with no copy."""
    for matrix in ("a", "b"):
        if not any(lora.borrowed() == matrix for lora in loras):  # a shared-outer half is one tensor already
            pack_contiguously([getattr(lora, matrix) for lora in loras])


def adapters_of(experts: torch.nn.Module, fc: str):
    """The adapter(s) of `fc`: a LoRA (shared), a list with one per local expert (per-expert, or shared-outer's, each
    borrowing the shared half), or None (none, or merged)."""
    held = experts._modules.get(f"lora_{fc}")
    if isinstance(held, LoRA):
        return held
    if held is not None:
        return list(held)
    if not hasattr(experts, "local_experts"):
        return None
    loras = [getattr(e, fc).adapter() if hasattr(getattr(e, fc), "adapter") else None for e in experts.local_experts]
    return loras if all(lora is not None for lora in loras) else None


def term(adapters):
    """`grouped_experts`' adapter term for `adapters` (as adapters_of gives them)."""
    if adapters is None:
        return None
    if isinstance(adapters, LoRA):
        return lambda x, offsets: adapters(x)  # no TP group: dropout, x A^T B^T scale over every token
    if adapters[0].borrowed():
        return lambda x, offsets: shared_outer(adapters, x, offsets)
    return lambda x, offsets: per_expert(adapters, x, offsets)


def per_expert(loras: list[LoRA], x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each expert's scale * B_e A_e on its rows of `x` (rows sorted by expert, `offsets` their cumulative ends)."""
    first = loras[0]
    if first.dropout is not None:
        x = first.dropout(x)
    a, b = stacked([lora.a for lora in loras]), stacked([lora.b for lora in loras])
    multiple = _STRIDE_BYTES // a.element_size()
    pad = -first.rank % multiple
    if pad:  # zero rows of A, zero columns of B: the same product
        a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
    h = F.grouped_mm(x.to(a.dtype), a.transpose(1, 2), offs=offsets)
    return F.grouped_mm(h, b.transpose(1, 2), offs=offsets) * first.scale


def shared_outer(loras: list[LoRA], x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """shared-outer adapters on rows of `x` sorted by expert: fc1's scale * B_e A (A borrowed, the same for every
    expert) or fc2's scale * B A_e (B borrowed). The rank-r intermediate is padded to the grouped GEMM's strides."""
    first = loras[0]
    if first.dropout is not None:
        x = first.dropout(x)
    pad = -first.rank % (_STRIDE_BYTES // first.a.element_size())
    if first.borrowed() == "a":
        h = F.linear(x.to(first.a.dtype), first.a)
        b = stacked([lora.b for lora in loras])
        if pad:  # zero columns of h, zero columns of B: the same product
            h, b = F.pad(h, (0, pad)), F.pad(b, (0, pad))
        return F.grouped_mm(h, b.transpose(1, 2), offs=offsets) * first.scale
    a = stacked([lora.a for lora in loras])
    if pad:
        a = F.pad(a, (0, 0, 0, pad))
    h = F.grouped_mm(x.to(a.dtype), a.transpose(1, 2), offs=offsets)
    return F.linear(h[:, :first.rank], first.b) * first.scale


class GroupedAdapters:
    """Mixed in before a grouped experts class: its forward with the adapters' terms; its checkpoint with the
    per-expert adapters it holds, under SequentialMLP's keys; its base class kept in `_experts_base`."""

    def adapter_terms(self) -> tuple:
        return tuple(term(adapters_of(self, fc)) for fc in FC)

    def forward(self, hidden, tokens_per_expert, probs, *args, **kwargs):
        if self.grouped_mm and not args and all(v is None for v in kwargs.values()):
            return super().forward(hidden, tokens_per_expert, probs, *args, **kwargs)
        if not hasattr(self, "local_experts"):  # transformer-engine's grouped linears (FP8): the terms on them
            with terms_on_grouped_linears(self, self.adapter_terms()):
                return super().forward(hidden, tokens_per_expert, probs, *args, **kwargs)
        if any(isinstance(self._modules.get(f"lora_{fc}"), torch.nn.ModuleList) for fc in FC):
            raise RuntimeError(f"{type(self).__name__}: adapters held by the experts module run in the grouped-GEMM "
                               f"forward, not on per-expert linears")
        return super().forward(hidden, tokens_per_expert, probs, *args, **kwargs)  # the linears add theirs

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for fc in FC:
            held = self._modules.get(f"lora_{fc}")
            if isinstance(held, torch.nn.ModuleList):
                for key in [k for k in state if k.startswith(f"{prefix}lora_{fc}.")]:
                    del state[key]  # the parent's helper saw them as replicated tensors
                state.update(held_sharded_state_dict(self, held, prefix, fc, sharded_offsets, metadata))
        return state


def held_sharded_state_dict(experts, loras, prefix: str, fc: str, sharded_offsets: tuple, metadata) -> dict:
    """The per-expert adapters `loras` of `fc` as SequentialMLP saves its expert linears' adapters: sharded keys
    `{prefix}experts.{fc}.lora.a` with the global expert axis (or `{prefix}experts.{g}.` with singleton local
    shards), replicas numbered over expert-data-parallel; state-dict keys the held modules' own."""
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

    metadata = dict(metadata or {})
    singleton = metadata.get("singleton_local_shards", False)
    total = experts.ep_group.size() * experts.num_local_experts
    offset = experts.ep_group.rank() * experts.num_local_experts
    state = {}
    for i, lora in enumerate(loras):
        g = offset + i
        own = f"{prefix}lora_{fc}.{i}."
        offsets = sharded_offsets if singleton else (*sharded_offsets, (len(sharded_offsets), g, total))
        part = lora.sharded_state_dict(own, offsets, metadata)
        replace_prefix_for_sharding(part, own, f"{prefix}experts.{g}.{fc}.lora." if singleton
                                    else f"{prefix}experts.{fc}.lora.")
        for tensor in part.values():
            tensor.replica_id = (*tensor.replica_id[:2], experts.dp_group.rank())
        state.update(part)
    return state


@torch.no_grad()
def merge_held(experts: torch.nn.Module) -> int:
    """Fold the adapters the experts module applies itself (held per-expert ones; shared ones where no per-expert
    linear refers to them) into its expert weights, in fp32, stored in the weight's dtype; the module keeps them
    (experts.drop_adapters removes them). Returns how many expert weights changed."""
    from mimo.plugins.kit.grouped_mm_moe import expert_weights

    changed = 0
    for fc, weights in zip(FC, expert_weights(experts)):
        held = experts._modules.get(f"lora_{fc}")
        if isinstance(held, torch.nn.ModuleList):
            loras = list(held)
        elif isinstance(held, LoRA) and not hasattr(experts, "local_experts"):
            loras = [held] * len(weights)
        else:  # none, or on the linears: linears.merge folds those
            continue
        for weight, lora in zip(weights, loras):
            weight.copy_((weight.float() + lora.delta_weight().to(weight.device)).to(weight.dtype))
            changed += 1
    return changed
