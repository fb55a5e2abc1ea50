"""Adapters onto a built MimoModel, before DDP wraps it: every base weight frozen (DDP then gives it no gradient
buffer, the optimizer no fp32 copy and no state), an adapter on each targeted layer, only adapters training.
And the reverse, merging: each adapter folded into its base weight in fp32, the model as it was built."""

from __future__ import annotations

import torch

from ..config import AdapterOptions
from . import experts as expert_adapters
from . import linears
from .lora import LoRA
from .targets import find, global_name


def add_adapters(model, options: AdapterOptions, targets: dict[str, tuple[str, ...]], *, seed: int) -> int:
    """Freeze `model` and give the layers `targets` names adapters of `options`' rank, scale and dropout, their A
    seeded from `seed` and each layer's global name (the same in every layout). Collective over the world (an
    unknown target is an error on every rank). Returns the number of adapters this rank built."""
    for param in model.parameters():
        param.requires_grad_(False)
    for module in model.modules():  # a frozen router's expert bias must not move either (megatron-core's flag)
        if hasattr(module, "frozen_expert_bias"):
            module.frozen_expert_bias = True

    def make_lora(sharding, weight, name: str, expert: bool, base=None) -> LoRA:
        # the base's weight (megatron-core's output layer may take the embedding's instead: then any parameter);
        # `base` the adapted linear, or the experts module holding its experts' adapters (experts.py)
        weight = weight if weight is not None else next(model.parameters())
        lora = LoRA(sharding, options.lora_rank, options.scale, options.lora_dropout, weight.dtype, weight.device,
                    expert=expert, row_parts=_row_parts(base, weight, name) if base is not None else None)
        lora.initialize(seed, name)
        return lora

    count = 0
    found = find(model, targets)
    for target in found:
        if target.experts:
            expert_adapters.check_experts(target.module, target.path)
    for target in found:
        name = global_name(model, target.path)
        if target.experts:
            count += expert_adapters.adapt_experts(target.module, options.lora_experts, make_lora, name)
        else:
            linear = target.module
            linears.attach(linear, make_lora(linears.sharding_of(linear), getattr(linear, "weight", None), name, False,
                                             linear))
            count += 1
    return count


def _row_parts(base, weight, name: str) -> list[int] | None:
    """The base weight's stacked outputs on this rank: as a layer declares them (`partition_sizes`, Mamba's
    in_proj), or a gated MLP's fc1 (gate and up halves, which megatron-core saves apart; `base` a linear or an
    experts module, whose config says whether it is gated)."""
    sizes = getattr(weight, "partition_sizes", None)
    if sizes:
        return list(sizes)
    config = getattr(base, "config", None)
    if name.endswith("linear_fc1") and getattr(config, "gated_linear_unit", False):
        return [weight.shape[0] // 2] * 2
    return None


def adapter_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every adapter parameter of `model`."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter_name(n)]


def is_adapter_name(name: str) -> bool:
    """Whether a parameter or checkpoint key belongs to an adapter (a module named lora or lora_<linear>)."""
    return any(part == "lora" or part.startswith("lora_") for part in name.split("."))


@torch.no_grad()
def merge_adapters(model) -> int:
    """Fold every adapter into its base weight (fp32 arithmetic, stored in the weight's dtype) and remove it: the
    model computes what base + adapters computed, with the layers and keys it was built with. Returns how many
    linears (or grouped experts' expert weights) changed."""
    adapted = [m for m in model.modules() if linears.is_adapted(m)]
    for linear in adapted:
        linears.merge(linear)
    changed = len(adapted)
    for module in list(model.modules()):
        changed += expert_adapters.merge_experts(module)
        expert_adapters.drop_adapters(module)
    return changed
