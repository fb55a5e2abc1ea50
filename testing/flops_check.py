"""FLOPs, through a `model_flops` hook when mimo declares one (telemetry is being added alongside this kit).

The hook's arguments are matched by name to what the checks know; its meaning (per token, per iteration, per
module) belongs to its hookspec, so only the form is checked: positive finite numbers.
"""

from __future__ import annotations

import math

from .report import ContractError
from .subject import Subject, hookspec_signatures

HOOK = "model_flops"


def check_flops(subject: Subject, shapes: dict, seq_length: int | None, micro_batch_size: int = 2):
    """Call `model_flops` if the hookspec exists. Returns (result, note): result None with a note saying why
    nothing was checked."""
    if HOOK not in hookspec_signatures():
        return None, f"FLOPs not checked: mimo.plugins.hookspecs has no '{HOOK}' hook"
    known = {"settings": subject.settings, "shapes": shapes, "model_shape": shapes, "seq_length": seq_length,
             "micro_batch_size": micro_batch_size, "batch_size": micro_batch_size,
             "global_batch_size": 2 * micro_batch_size}
    caller = subject.hook(HOOK)
    names = list(caller.spec.argnames) if caller.spec else []
    unknown = [n for n in names if n not in known]
    if unknown:
        return None, f"FLOPs not checked: {HOOK}{tuple(names)} takes {unknown}, which mimo.testing cannot supply"
    result = subject.call(HOOK, **{n: known[n] for n in names})
    firstresult = bool(caller.spec and caller.spec.opts.get("firstresult"))
    result = result if firstresult else (result[0] if result else None)
    if result is None:  # optional, like ModuleShape.num_parameters: no implementation reports FLOPs
        return None, f"FLOPs not reported: no implementation of '{HOOK}' returned a value"
    values = _numbers(result)
    if values is None:
        raise ContractError(HOOK, f"must return a number or {{name: number}} of FLOPs, got {result!r}")
    bad = [v for v in values if not (math.isfinite(v) and v > 0)]
    if bad:
        raise ContractError(HOOK, f"returned {bad[0]!r}; FLOPs must be positive and finite")
    return result, None


def _numbers(result) -> list[float] | None:
    if isinstance(result, bool):
        return None
    if isinstance(result, (int, float)):
        return [float(result)]
    if isinstance(result, dict) and result and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   for v in result.values()):
        return [float(v) for v in result.values()]
    return None
