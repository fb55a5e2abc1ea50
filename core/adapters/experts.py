"""Adapters on a MoE layer's routed experts: megatron-core's `SequentialMLP` (one MLP per expert, its fc1 and fc2
megatron-core linears), in one of two layouts (`--lora-experts`):

* shared: one adapter for fc1 and one for fc2 per layer, used by every expert of the layer on every
  expert-parallel rank. Their parameters are dense ones (reduced over the whole data-parallel group, which spans
  the expert-parallel ranks: each rank's gradient covers the tokens its experts saw), held by the experts module as
  `lora_linear_fc1` / `lora_linear_fc2`.
* per-expert: one adapter per expert and linear, an expert parameter like the expert's weights (reduced over the
  expert-data-parallel group, saved under the expert's global index).

Grouped-GEMM experts (transformer-engine's TEGroupedMLP, megatron-core's GroupedMLP) run no per-expert linear and
are refused; mimo's own grouped-GEMM SequentialMLP runs megatron-core's per-expert path under adapters.
"""

from __future__ import annotations

import torch

from mimo.errors import UsageError

from . import linears

FC = ("linear_fc1", "linear_fc2")
_shared_classes: dict[type, type] = {}


class _SharedAdapters:
    """Mixed in before a SequentialMLP's class: its checkpoint also holds the experts' shared adapters."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for fc in FC:
            state.update(self._modules[f"lora_{fc}"].sharded_state_dict(f"{prefix}lora_{fc}.", sharded_offsets,
                                                                        metadata))
        return state


def check_experts(experts: torch.nn.Module, where: str) -> None:
    """UsageError unless adapters can wrap these experts."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    if not isinstance(experts, SequentialMLP):
        raise UsageError(f"--lora-targets experts: the routed experts of {where} are {type(experts).__name__} "
                         f"(grouped GEMMs), which adapters do not wrap; build megatron-core's SequentialMLP experts "
                         f"(a provider setting may choose them) or leave experts out of the targets")
    if experts.tp_group is not None and experts.tp_group.size() > 1:
        raise UsageError(f"--lora-targets experts: {where} splits its experts over {experts.tp_group.size()} expert "
                         f"tensor-parallel ranks, which expert adapters do not support; use --llm-expt-tp 1")


def adapt_experts(experts: torch.nn.Module, layout: str, make_lora, name: str) -> int:
    """Give every local expert of `experts` (a SequentialMLP) adapters on fc1 and fc2. `make_lora(linear, name,
    expert)` builds one for a linear, `name` layout-independent; returns how many adapters this rank built."""
    if hasattr(experts, "grouped_mm"):  # mimo's grouped-GEMM SequentialMLP: megatron-core's per-expert forward
        experts.grouped_mm = False
    local = experts.local_experts
    if layout == "per-expert":
        offset = experts.ep_group.rank() * experts.num_local_experts
        for i, expert in enumerate(local):
            for fc in FC:
                linear = getattr(expert, fc)
                linears.attach(linear, make_lora(linear, f"{name}.{offset + i}.{fc}", True))
        return len(local) * len(FC)
    for fc in FC:
        lora = make_lora(getattr(local[0], fc), f"{name}.shared.{fc}", False)
        experts.add_module(f"lora_{fc}", lora)
        for expert in local:
            linears.attach(getattr(expert, fc), lora, owned=False)
    if type(experts) not in _shared_classes:
        base = type(experts)
        _shared_classes[base] = type(f"LoRAShared{base.__name__}", (_SharedAdapters, base), {"__module__": __name__})
    experts.__class__ = _shared_classes[type(experts)]
    return len(FC)


def drop_shared(experts: torch.nn.Module) -> None:
    """After merging: the experts module without its shared adapters, in its own class again."""
    if isinstance(experts, _SharedAdapters):
        for fc in FC:
            del experts._modules[f"lora_{fc}"]
        experts.__class__ = next(c for c in type(experts).__mro__[1:] if not issubclass(c, _SharedAdapters))
