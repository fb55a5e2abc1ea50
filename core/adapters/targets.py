"""Which layers of a MimoModel `--lora-targets` names: per module (`language`, a modality's encoders, `projection`:
every modality's input projections), layer names as the model names its linears (`linear_qkv`, `in_proj`, ...),
`experts` (a MoE layer's routed experts), `shared_experts` (the linears of its shared experts) or `all`.

A plain layer name never reaches into the experts: `linear_fc1` is the dense MLPs' fc1, not the experts'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mimo.errors import UsageError
from mimo.plugins import LANGUAGE

from ..config.adapters import ALL, EXPERTS, PROJECTION, SHARED_EXPERTS, parse_targets
from .linears import sharding_of


@dataclass
class Target:
    """One place that gets adapters: a linear, or a MoE layer's routed experts (`experts` True)."""

    module: torch.nn.Module
    path: str  # from the MimoModel, e.g. language_model.decoder.layers.1.mlp.experts
    experts: bool = False


def target_modules(modalities) -> list[str]:
    """The names --lora-targets may use for modules."""
    return [LANGUAGE, *modalities, PROJECTION]


def resolve(text: str | None, default: dict | None, modalities, provider: str) -> dict[str, tuple[str, ...]]:
    """--lora-targets (`text`) or else the provider's default, checked against the model's modules."""
    if text is not None:
        targets, origin = parse_targets(text), "--lora-targets"
    elif default:
        targets, origin = {m: tuple(names) for m, names in default.items()}, f"provider '{provider}''s lora_targets"
    else:
        raise UsageError(f"--lora-rank needs --lora-targets (provider '{provider}' declares no default targets), "
                         f"e.g. --lora-targets '{LANGUAGE}:{ALL}'")
    valid = target_modules(modalities)
    for module in targets:
        if module not in valid:
            raise UsageError(f"{origin} names module '{module}'; choose among {', '.join(valid)}")
    return targets


def _roots(model, module: str) -> list[tuple[str, torch.nn.Module]]:
    """(path prefix, module) of what `module` names that this rank holds."""
    subs = model.modality_submodules
    if module == LANGUAGE:
        return [("language_model", model.language_model)] if model.language_model is not None else []
    if module == PROJECTION:
        return [(f"modality_submodules.{m}.input_projections", s.input_projections)
                for m, s in subs.items() if s is not None]
    held = subs[module] if module in subs else None
    return [(f"modality_submodules.{module}.encoders", held.encoders)] if held is not None else []


def _layers(root: torch.nn.Module):
    """(relative path, module, kind) of every layer adapters may wrap: kind 'linear', 'shared' (a shared
    expert's linear) or 'experts' (a MoE layer's routed experts, whose linears are not listed apart)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    routed = []
    for path, module in root.named_modules():
        if any(path.startswith(f"{r}.") for r in routed):
            continue
        parent_path, _, name = path.rpartition(".")
        if name == "experts" and isinstance(root.get_submodule(parent_path) if parent_path else root, MoELayer):
            routed.append(path)
            yield path, module, EXPERTS
        elif sharding_of(module) is not None:
            yield path, module, "shared" if ".shared_experts." in f".{path}." else "linear"


def _matches(path: str, kind: str, names: tuple[str, ...]) -> bool:
    if ALL in names:
        return True
    if kind == EXPERTS:
        return EXPERTS in names
    if kind == "shared":
        return SHARED_EXPERTS in names
    return path.rpartition(".")[2] in names


def find(model, targets: dict[str, tuple[str, ...]]) -> list[Target]:
    """This rank's layers that `targets` names. A name that matches no layer on any rank is one line naming the
    names that module has (world collective: in a heterogeneous layout a rank holds only its own modules)."""
    import torch.distributed as dist

    found, offered = [], {}
    for module, names in targets.items():
        offered[module] = set()
        for prefix, root in _roots(model, module):
            for path, layer, kind in _layers(root):
                name = {EXPERTS: EXPERTS, "shared": SHARED_EXPERTS}.get(kind, path.rpartition(".")[2])
                offered[module].add(name)
                if _matches(path, kind, names):
                    found.append(Target(layer, f"{prefix}.{path}", kind == EXPERTS))
    everywhere = [None] * dist.get_world_size()
    dist.all_gather_object(everywhere, offered)
    for module, names in targets.items():
        known = set().union(*(o[module] for o in everywhere))
        unknown = [n for n in names if n != ALL and n not in known]
        if unknown or not known:
            listed = ", ".join(sorted(known | {ALL})) if known else "none: it has no linear adapters wrap"
            raise UsageError(f"--lora-targets {module}: no layer named '{unknown[0] if unknown else ALL}' there; "
                             f"its layers: {listed}")
    return found


def global_name(model, path: str) -> str:
    """`path` with each layer's index replaced by its global layer number (the same under any pipeline split), so
    that adapters are seeded alike in every layout."""
    parts, module, out = path.split("."), model, []
    for part in parts:
        module = getattr(module, part) if not part.isdigit() else module[int(part)]
        number = getattr(module, "layer_number", None)
        out.append(str(number) if part.isdigit() and isinstance(number, int) else part)
    return ".".join(out)
