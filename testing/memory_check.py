"""`module_memory` (optional): what it reports must be the model mimo builds, so `mimo plan`'s estimate is.

Statically, one `ModuleMemory` per module of model_shape whose layers give the declared parameter count and whose
activation formulas give finite, non-negative bytes for every recompute mode. The worker then compares the counts
with the modules it builds on the CPU (`built_parameter_mismatch`, called there).
"""

from __future__ import annotations

import math

from mimo.plugins import ModuleMemory, ModuleShape
from mimo.plugins.memory import RECOMPUTE

from .report import ContractError
from .subject import Subject

HOOK = "module_memory"


def check_module_memory(subject: Subject, shapes: dict[str, ModuleShape]) -> str | None:
    """Check the hook's result against model_shape; returns a note when the provider has no such hook."""
    described = subject.call(HOOK, settings=subject.settings)
    if described is None:
        return f"memory not estimated: no implementation of '{HOOK}' returned a value"
    if not isinstance(described, dict) or not all(isinstance(m, ModuleMemory) for m in described.values()):
        raise ContractError(HOOK, f"must return {{module name: mimo.plugins.ModuleMemory}}, got "
                                  f"{type(described).__name__}")
    if sorted(described) != sorted(shapes):
        raise ContractError(HOOK, f"describes modules {sorted(described)} but model_shape declared {sorted(shapes)}")
    for name, module in described.items():
        declared = shapes[name].num_parameters
        if declared is not None and module.weights.total != declared:
            raise ContractError(HOOK, f"'{name}': its layers hold {module.weights.total:,} parameters but "
                                      f"model_shape declared {declared:,}")
        for layer in (module.first, *module.layers, module.last):
            for mode in RECOMPUTE:
                for value_bytes in (2, 4):
                    for kept in (layer.kept(mode, value_bytes), layer.working(mode, value_bytes)):
                        if not all(math.isfinite(x) and x >= 0 for x in (kept.replicated, kept.tp, kept.expert)):
                            raise ContractError(HOOK, f"'{name}': layer '{layer.kind}' keeps {kept} per token "
                                                      f"under recompute {mode}; bytes must be finite and >= 0")
    return None


def built_parameter_mismatch(described: dict | None, built: dict[str, int]) -> str | None:
    """On a world of one (no split), each module's described parameters against the module built; a rule
    broken, or None."""
    for name, module in (described or {}).items():
        if name in built and module.weights.total != built[name]:
            return (f"'{name}': its layers hold {module.weights.total:,} parameters but the built module has "
                    f"{built[name]:,}")
    return None
