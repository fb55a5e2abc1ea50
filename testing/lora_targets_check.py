"""`lora_targets` (optional): the default LoRA targets must name the provider's modules (or "projection") with
lists of layer names, or `mimo run --lora-rank R` would fail at start-up without saying the provider is at fault.
Whether each name matches a layer is checked where the model is built (mimo.core.adapters.targets)."""

from __future__ import annotations

from mimo.plugins import LANGUAGE

from .report import ContractError
from .subject import Subject, hookspec_signatures

HOOK = "lora_targets"


def check_lora_targets(subject: Subject, shapes: dict) -> None:
    if HOOK not in hookspec_signatures():
        return
    returned = subject.call(HOOK, settings=subject.settings)
    if returned is None:
        return
    modules = [LANGUAGE, *sorted(m for m in shapes if m != LANGUAGE), "projection"]
    if not isinstance(returned, dict) or not returned:
        raise ContractError(HOOK, f"must return {{module: [layer name, ...]}}, got {type(returned).__name__}")
    for module, names in returned.items():
        if module not in modules:
            raise ContractError(HOOK, f"names module {module!r}; the modules are {', '.join(modules)}")
        if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names):
            raise ContractError(HOOK, f"{module}: give a non-empty list of layer names, got {names!r}")
