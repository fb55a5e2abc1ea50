"""megatron-core's linear layers with an adapter: the layer object stays (its weight, name, checkpoint key and
every attribute other code set on it), its class becomes a subclass that adds the adapter's output to its own.

Local backend: `ColumnParallelLinear`, `RowParallelLinear`. transformer-engine: `TEColumnParallelLinear`,
`TERowParallelLinear`, `TELayerNormColumnParallelLinear` (asked to return its normalized input as well, which the
adapter takes: the layer norm belongs to the frozen base). The adapter is the layer's child `lora`; routed experts
sharing one adapter (experts.py) hold it elsewhere and the layer refers to it without owning it.
"""

from __future__ import annotations

import torch

from .lora import COLUMN, ROW, LoRA, Sharding

_SHARED = "_shared_lora"  # where a layer keeps an adapter it uses and does not own (not a registered child)
_adapted_classes: dict[type, type] = {}


class _Adapted:
    """Mixed in before the base layer's class: the base's forward, plus the adapter's output."""

    def adapter(self) -> LoRA | None:
        return self._modules.get("lora") or self.__dict__.get(_SHARED)

    def forward(self, input_, *args, **kwargs):
        result = super().forward(input_, *args, **kwargs)
        lora = self.adapter()
        if lora is None:  # merged, or never given one
            return result
        if getattr(self, "return_layernorm_output", False):  # transformer-engine's LayerNormLinear
            return _with_normalized_input(result, lora)
        output, bias = result
        # a linear with its own input norm in front (as transformer-engine's fused one) names it `norm`: the
        # adapter, like the base weight, sees the normalized input
        if callable(getattr(self, "norm", None)):
            input_ = self.norm(input_)
        return output + lora(input_).to(output.dtype), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        # the base's helper took the adapter's tensors for replicated ones: its own sharding replaces them
        for key in [k for k in state if k.startswith(f"{prefix}lora.")]:
            del state[key]
        if "lora" in self._modules:
            state.update(self.lora.sharded_state_dict(f"{prefix}lora.", sharded_offsets, metadata))
        return state


def _with_normalized_input(result, lora: LoRA):
    """transformer-engine's LayerNormLinear asked for its layer norm's output: (out, bias, ln_out) when it returns
    its bias, else megatron-core's ((out, ln_out), None). The adapter reads ln_out; the caller gets (out, bias)."""
    if len(result) == 3:
        output, bias, normalized = result
    else:
        (output, normalized), bias = result
    return output + lora(normalized).to(output.dtype), bias


def adapted_class(base: type) -> type:
    if base not in _adapted_classes:
        _adapted_classes[base] = type(f"LoRA{base.__name__}", (_Adapted, base), {"__module__": __name__})
    return _adapted_classes[base]


def is_adapted(module: torch.nn.Module) -> bool:
    return isinstance(module, _Adapted)


def sharding_of(linear: torch.nn.Module) -> Sharding | None:
    """How `linear` splits over its TP ranks, or None for a layer that is no linear adapters wrap."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(linear, ColumnParallelLinear):
        return Sharding(COLUMN, linear.input_size, linear.output_size_per_partition, _comm_group(linear),
                        linear.sequence_parallel, linear.gather_output)
    if isinstance(linear, RowParallelLinear):
        return Sharding(ROW, linear.input_size_per_partition, linear.output_size, _comm_group(linear),
                        linear.sequence_parallel, input_is_parallel=linear.input_is_parallel)
    return _te_sharding(linear)


def _comm_group(linear):
    """The group the adapter communicates over: none at one rank, nor where the layer leaves its communication
    to the MoE token dispatcher (experts.py refuses expert TP, where that would leave A's gradient partial)."""
    group = linear.tp_group
    if group is None or group.size() == 1 or getattr(linear, "explicit_expert_comm", False):
        return None
    return group


def _te_sharding(linear) -> Sharding | None:
    try:
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear, TELayerNormColumnParallelLinear, TERowParallelLinear,
        )
    except ImportError:
        return None
    classes = tuple(c for c in (TEColumnParallelLinear, TELayerNormColumnParallelLinear, TERowParallelLinear)
                    if isinstance(c, type))  # without transformer-engine megatron-core leaves them None
    if not classes or not isinstance(linear, classes):
        return None
    mode = ROW if isinstance(linear, TERowParallelLinear) else COLUMN
    out_features, in_features = linear.weight.shape
    communicates = linear.parallel_mode in (COLUMN, ROW) and linear.tp_size > 1
    group = (getattr(linear, "_tp_group", None) or linear.tp_group) if communicates else None
    return Sharding(mode, in_features, out_features, group, communicates and linear.sequence_parallel)


def attach(linear: torch.nn.Module, lora: LoRA, owned: bool = True) -> None:
    """Give `linear` the adapter: its child `lora` (`owned`), or a reference to one that another module holds."""
    linear.__class__ = adapted_class(type(linear))
    if owned:
        linear.lora = lora
    else:
        linear.__dict__[_SHARED] = lora
    if hasattr(linear, "return_layernorm_output"):  # the adapter's input is the layer norm's output
        linear.return_layernorm_output = True
        linear.return_layernorm_output_gathered = False


def detach(linear: torch.nn.Module) -> None:
    """The layer as it was built: its own class, no adapter."""
    if "lora" in linear._modules:
        del linear._modules["lora"]
    linear.__dict__.pop(_SHARED, None)
    if hasattr(linear, "return_layernorm_output"):
        linear.return_layernorm_output = False
    linear.__class__ = next(c for c in type(linear).__mro__[1:] if c is not _Adapted and not issubclass(c, _Adapted))


@torch.no_grad()
def merge(linear: torch.nn.Module) -> None:
    """Fold the adapter into the base weight (in fp32, then the weight's dtype) and detach it."""
    lora = linear.adapter()
    weight = linear.weight
    weight.copy_((weight.float() + lora.delta_weight().to(weight.device)).to(weight.dtype))
    detach(linear)
