"""The transformer-engine-only speed-ups of `backend=te` runs (fused cross-entropy, shared-expert overlap, weight
gradients accumulated inside the GEMM, CUDA graphs of parts of a hybrid LLM), which no CPU can check. Each has a
switch of its own (a provider setting or a loop option); `MIMO_TE_EXTRAS=0` in the environment turns all of them
off at once, to tell whether one of them is behind a failure or a changed loss."""

from __future__ import annotations

import os

TE_EXTRAS_ENV = "MIMO_TE_EXTRAS"


def te_extras_enabled() -> bool:
    """False when the environment says MIMO_TE_EXTRAS=0 (or off/false/no)."""
    return os.environ.get(TE_EXTRAS_ENV, "1").strip().lower() not in ("0", "off", "false", "no")
