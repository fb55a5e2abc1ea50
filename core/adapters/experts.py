"""Adapters on a MoE layer's routed experts: megatron-core's `SequentialMLP` (one MLP per expert, its fc1 and fc2
megatron-core linears) and mimo's grouped-GEMM experts (grouped_experts.py), in one of three layouts
(`--lora-experts`):

* shared: one adapter for fc1 and one for fc2 per layer, used by every expert of the layer on every
  expert-parallel rank. Their parameters are dense ones (reduced over the whole data-parallel group, which spans
  the expert-parallel ranks: each rank's gradient covers the tokens its experts saw), held by the experts module as
  `lora_linear_fc1` / `lora_linear_fc2`.
* per-expert: one adapter per expert and linear, an expert parameter like the expert's weights (reduced over the
  expert-data-parallel group, saved under the expert's global index).
* shared-outer: per expert and linear, the half on the expert's inner (ffn) side is its own, the half on the
  layer's hidden-size side one for all experts of the layer: fc1's B_e A and fc2's B A_e. Each expert's adapter is
  a per-expert one that borrows the shared half (LoRA.borrow); the experts module holds the shared halves as
  `lora_outer_linear_fc1` (A) / `lora_outer_linear_fc2` (B), dense parameters and saved as the shared layout's.

transformer-engine's TEGroupedMLP and megatron-core's GroupedMLP as megatron-core builds them run their own grouped
linears, which take no adapter: refused, as is expert tensor parallelism. mimo's GroupedMMExperts (TEGroupedMLP)
kept on transformer-engine's grouped linears by FP8/FP4 get the grouped-GEMM path's terms added to those linears'
outputs (te_grouped_linears.py).
"""

from __future__ import annotations

import torch

from mimo.errors import UsageError

from . import grouped_experts, linears
from .lora import LoRA

FC = ("linear_fc1", "linear_fc2")
OUTER = {"linear_fc1": "a", "linear_fc2": "b"}  # shared-outer: the matrix on the layer's hidden-size side
_adapted_classes: dict[tuple, type] = {}


class _SharedAdapters:
    """Mixed in before an experts class: its checkpoint also holds the experts' shared adapters (or shared halves)."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for name, module in self._modules.items():
            if name.startswith("lora_") and isinstance(module, LoRA):  # shared, or shared-outer's halves
                for key in [k for k in state if k.startswith(f"{prefix}{name}.")]:
                    del state[key]  # a parent that walks its children (TEGroupedMLP) saw them as replicated tensors
                state.update(module.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
        return state


def check_experts(experts: torch.nn.Module, where: str) -> None:
    """UsageError unless adapters can wrap these experts."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    if grouped_experts.is_grouped(experts):
        grouped_experts.check_grouped(experts, where)
    elif not isinstance(experts, SequentialMLP):
        raise UsageError(f"--lora-targets experts: the routed experts of {where} are {type(experts).__name__} "
                         f"(transformer-engine's or megatron-core's grouped linears), which adapters do not wrap; "
                         f"build mimo's grouped-GEMM experts or megatron-core's SequentialMLP (Nemotron: "
                         f"expert_gemm=grouped_mm or megatron) or leave experts out of the targets")
    if experts.tp_group is not None and experts.tp_group.size() > 1:
        raise UsageError(f"--lora-targets experts: {where} splits its experts over {experts.tp_group.size()} expert "
                         f"tensor-parallel ranks, which expert adapters do not support; use --llm-expt-tp 1")


def adapt_experts(experts: torch.nn.Module, layout: str, make_lora, name: str, hold: bool | None = None) -> int:
    """Give every local expert of `experts` adapters on fc1 and fc2. `make_lora(sharding, weight, name, expert,
    base)` builds one for an expert linear's sharding and weight, `name` layout-independent, `base` the linear (or
    the experts module, for adapters it holds: its config, as the linear's, says whether fc1 is gated, whose B is
    then saved in gate and linear parts). Per-expert adapters go on
    the experts' linears, or (`hold`; by default where there are no per-expert linears) into the experts module.
    Returns how many adapters this rank built."""
    hold = grouped_experts.holds_per_expert(experts) if hold is None else hold
    if layout == "shared-outer":
        make_lora = _borrowing_outer(experts, make_lora, name)
    if layout != "shared" and hold:
        count = grouped_experts.hold_per_expert(experts, lambda s, w, n: make_lora(s, w, n, True, experts), name)
    elif layout != "shared":
        local = experts.local_experts
        offset = experts.ep_group.rank() * experts.num_local_experts
        for i, expert in enumerate(local):
            for fc in FC:
                linear = getattr(expert, fc)
                linears.attach(linear, _lora_for(linear, make_lora, f"{name}.{offset + i}.{fc}", True))
        if grouped_experts.is_grouped(experts):  # the grouped forward stacks them: back to back, no copy
            for fc in FC:
                grouped_experts.pack([getattr(e, fc).lora for e in local])
        count = len(local) * len(FC)
    else:
        for fc in FC:
            lora = _shared_lora(experts, make_lora, name, fc)
            experts.add_module(f"lora_{fc}", lora)
            for expert in getattr(experts, "local_experts", ()):
                linears.attach(getattr(expert, fc), lora, owned=False)
        count = len(FC)
    mixins = ((grouped_experts.GroupedAdapters,) if grouped_experts.is_grouped(experts) else ()) + (
        (_SharedAdapters,) if layout != "per-expert" else ())
    if mixins:
        experts.__class__ = _adapted_class(type(experts), mixins)
    return count


def _shared_lora(experts, make_lora, name: str, fc: str) -> LoRA:
    """One dense adapter for `fc` of all the layer's experts, shaped as one expert's."""
    linear = getattr(experts.local_experts[0], fc) if hasattr(experts, "local_experts") else None
    return (_lora_for(linear, make_lora, f"{name}.shared.{fc}", False) if linear is not None else
            make_lora(*grouped_experts.expert_sharding(experts, fc), f"{name}.shared.{fc}", False, experts))


def _borrowing_outer(experts, make_lora, name: str):
    """shared-outer: the experts module gets each linear's shared half (`lora_outer_<fc>`, a dense adapter keeping
    only its outer matrix, A drawn as the shared layout's); returns a `make_lora` whose per-expert adapters borrow
    it, before anything packs their own halves."""
    outer = {}
    for fc in FC:
        holder = _shared_lora(experts, make_lora, name, fc)
        del holder._parameters["b" if OUTER[fc] == "a" else "a"]  # each expert's own
        experts.add_module(f"lora_outer_{fc}", holder)
        outer[fc] = getattr(holder, OUTER[fc])

    def make_expert_lora(sharding, weight, lora_name: str, expert: bool, base=None) -> LoRA:
        lora = make_lora(sharding, weight, lora_name, expert, base)
        fc = lora_name.rsplit(".", 1)[1]
        lora.borrow(OUTER[fc], outer[fc])
        return lora

    return make_expert_lora


def _lora_for(linear, make_lora, name: str, expert: bool):
    return make_lora(linears.sharding_of(linear), linear.weight, name, expert, linear)


def _adapted_class(base: type, mixins: tuple) -> type:
    key = (base, mixins)
    if key not in _adapted_classes:
        cls = type(f"LoRA{base.__name__}", (*mixins, base), {"__module__": __name__})
        cls._experts_base = base
        _adapted_classes[key] = cls
    return _adapted_classes[key]


@torch.no_grad()
def merge_experts(experts: torch.nn.Module) -> int:
    """Fold the adapters an experts module applies itself (grouped experts without per-expert linears) into its
    expert weights; the linears' adapters are linears.merge's. Returns how many weights changed."""
    return grouped_experts.merge_held(experts) if grouped_experts.is_grouped(experts) else 0


def drop_adapters(experts: torch.nn.Module) -> None:
    """After merging: the experts module without the adapters it holds, in its own class again."""
    base = getattr(type(experts), "_experts_base", None)
    if base is not None:
        for fc in FC:
            experts._modules.pop(f"lora_{fc}", None)
            experts._modules.pop(f"lora_outer_{fc}", None)
        experts.__class__ = base
