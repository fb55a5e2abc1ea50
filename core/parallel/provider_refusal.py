"""The provider's own refusal of a layout or option, asked before any process exists.

A provider checks what it can build inside `build_encoders` and `build_language_model` (a backend without sequence
or context parallelism, heads that do not split over TP x CP, FP8 on the local backend) and raises ValueError. Those
hooks return megatron-core specs, no weights, so `mimo plan` and `mimo run`'s launcher build them once, without
process groups, and refuse in one line what every worker would otherwise refuse after the processes started. It
needs the provider's settings and the run's options, which a Layout does not hold, so the plan asks it once after
`Layout.check()` (and `mimo plan --suggest` once per way of splitting the LLM's sequence).
"""

from __future__ import annotations

import dataclasses


def provider_refusal(plan, layout=None) -> str | None:
    """Why the provider refuses its modules laid out as `layout` (the plan's own by default), or None. None
    too for a plan made for GPUs on a host without one (`mimo plan --device cuda` on a login node): a provider
    checks its backend against this machine; the workers' build still refuses there."""
    import torch

    if plan.config.training.device == "cuda" and not torch.cuda.is_available():
        return None
    laid_out = plan if layout is None else dataclasses.replace(plan, layout=layout)
    ctx = laid_out.build_context({})
    try:
        plan.hooks.build_language_model(settings=plan.settings, ctx=ctx)
        plan.hooks.build_encoders(settings=plan.settings, ctx=ctx)
    except ValueError as err:
        return str(err)
    return None
