"""FLOPs, through a `model_flops` hook when mimo declares one (telemetry is being added alongside this kit), and
the per-sample count of `sample_flops`.

The hook's arguments are matched by name to what the checks know; its meaning (per token, per iteration, per
module) belongs to its hookspec, so only the form is checked: positive finite numbers. `sample_flops` is checked
to name model_flops's modules, to grow with a sample's tokens, and to add up by part.
"""

from __future__ import annotations

import math

from .report import ContractError
from .subject import Subject, hookspec_signatures

HOOK = "model_flops"
SAMPLE_HOOK = "sample_flops"


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


def check_sample_flops(subject: Subject, flops, seq_length: int | None) -> str | None:
    """Call `sample_flops` (when mimo declares it) for samples of a few sizes: `{module: FLOPs}` with
    model_flops's modules, finite and not negative, more for more tokens, no less with an image, and a sample's
    tokens and image apart adding up to the two together. Returns a note when nothing was checked."""
    if SAMPLE_HOOK not in hookspec_signatures():
        return f"sample FLOPs not checked: mimo.plugins.hookspecs has no '{SAMPLE_HOOK}' hook"
    tokens = max((seq_length or 32) // 2, 2)
    counted = {}
    shapes = {"short": (tokens // 2, []), "long": (tokens, []), "image": (tokens, [16]), "image alone": (0, [16])}
    for name, (n, patches) in shapes.items():
        result = subject.call(SAMPLE_HOOK, settings=subject.settings, tokens=n, image_patches=patches)
        if result is None:
            return f"sample FLOPs not reported: no implementation of '{SAMPLE_HOOK}' returned a value"
        values = _numbers(result) if isinstance(result, dict) else None
        if values is None or any(not (math.isfinite(v) and v >= 0) for v in values):
            raise ContractError(SAMPLE_HOOK, f"must return {{module: FLOPs}}, finite and not negative, got {result!r}")
        if isinstance(flops, dict) and set(result) != set(flops):
            raise ContractError(SAMPLE_HOOK, f"names modules {sorted(result)}, model_flops {sorted(flops)}")
        counted[name] = sum(values)
    if not counted["short"] < counted["long"] <= counted["image"]:
        raise ContractError(SAMPLE_HOOK, f"a sample of {tokens} tokens must count more than one of {tokens // 2}, "
                                         f"and no less with an image of 16 patches: got {counted}")
    if not math.isclose(counted["image"], counted["long"] + counted["image alone"], rel_tol=1e-9):
        raise ContractError(SAMPLE_HOOK, f"a sample's FLOPs must be its tokens' and its images' apart (the loop "
                                         f"adds them up): {counted['image']!r} for {tokens} tokens and an image, "
                                         f"{counted['long']!r} + {counted['image alone']!r} apart")
    return None
