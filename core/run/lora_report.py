"""What a LoRA run (--lora-rank) says about its adapters where it starts and ends: their rank, targets, the
parameters that train (counted in the built model, whole over every rank) against the model's, and the base.
The same figures go into its checkpoints (`mimo ckpt inspect` shows them without building anything)."""

from __future__ import annotations

import math

import torch.distributed as dist

from ..checkpoint import adapter_state
from ..checkpoint.match import model_shapes
from ..parallel.topology import LANGUAGE


def adapter_counts(model) -> dict[str, int]:
    """{module: its adapters' parameters in the whole model}: the global shapes of the adapter tensors a checkpoint
    holds, each shard and replica once, whatever the layout. Collective over the world."""
    state = adapter_state.model_part(model.sharded_state_dict(), adapter_state.ADAPTERS)
    sizes = {key: math.prod(shape) for key, shape in model_shapes(state).items()}
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sizes)
        sizes = {key: size for part in everyone for key, size in part.items()}
    counts: dict[str, int] = {}
    for key, size in sizes.items():
        module = module_of(key)
        counts[module] = counts.get(module, 0) + size
    return counts


def module_of(key: str) -> str:
    """The module a parameter or checkpoint key belongs to: `language` or the modality (its encoders and input
    projection)."""
    parts = key.split(".")
    return parts[1] if parts[0] == "modality_submodules" and len(parts) > 1 else LANGUAGE


def targets_text(targets: dict) -> str:
    """{module: names} as --lora-targets takes them: `language: linear_qkv, linear_proj; projection: all`."""
    return "; ".join(f"{module}: {', '.join(names)}" for module, names in targets.items())


def trainable(adapters: int, base: int | None) -> str:
    """`12,320 trainable params (6.0% of 205,496)`; without the base's count, the count alone."""
    if not base:
        return f"{adapters:,} trainable params"
    return f"{adapters:,} trainable params ({100 * adapters / (base + adapters):.1f}% of {base + adapters:,})"


def base_count(plan) -> int | None:
    """The base's parameters as the provider counts them (the run's first line shows them per module)."""
    counts = [shape.num_parameters for shape in plan.shapes.values()]
    return sum(counts) if counts and all(counts) else None


def record(plan, counts: dict[str, int]) -> dict:
    """What a checkpoint of the run keeps about its adapters (beside their --lora-* options): the targets they
    were built on and their parameters per module."""
    return {"targets": {m: list(names) for m, names in (plan.adapter_targets or {}).items()},
            "parameters": dict(counts)}


def header(plan, counts: dict[str, int]) -> str:
    """The part of the run's first line that says it trains adapters."""
    return f" | LoRA rank {plan.config.adapters.lora_rank}, " + trainable(sum(counts.values()), base_count(plan))


def details(plan, counts: dict[str, int], base: dict) -> str:
    """The line after the first: the adapters' options and targets, their parameters per module, the base."""
    a = plan.config.adapters
    experts = f", experts {a.lora_experts}" if any(s.num_experts for s in plan.shapes.values()) else ""
    dropout = f", dropout {a.lora_dropout:g}" if a.lora_dropout else ""
    per_module = ", ".join(f"{name} {count:,}" for name, count in counts.items())
    return (f"LoRA adapters: rank {a.lora_rank}, alpha {a.scale * a.lora_rank:g}{experts}{dropout} on "
            f"{targets_text(plan.adapter_targets or {})}; {per_module} trainable params; base "
            f"{adapter_state.describe(base)}, frozen")


def summary(plan, counts: dict[str, int], base: dict) -> str:
    """The summary's line: what trained, on which base, and what the checkpoints hold."""
    saved = "; checkpoints hold the adapters alone" if plan.config.checkpoint.save else ""
    return (f"  LoRA: rank {plan.config.adapters.lora_rank} adapters, "
            f"{trainable(sum(counts.values()), base_count(plan))}, on base {adapter_state.describe(base)}{saved}")
