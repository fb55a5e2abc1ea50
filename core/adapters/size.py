"""How many adapter parameters a module gets, bounded from its memory description alone: the memory plan builds no
model and does not know which layer holds which linear.

An adapter of rank r on a linear [out, in] holds r (in + out) parameters, at most 2r / h of the linear's in x out
when both sides are at least the module's hidden size h. The plan therefore counts 2r / h of the module's
tensor-parallel weights (its linears and embeddings) in its layers (when the module is a target) and in its last
stage's part (the projection, when `projection` is a target). Routed experts are counted exactly, whatever their
FFN size f and gating g (fc1 [g f, h], fc2 [h, f]): an expert of w = (g + 1) f h weights gets r (h + g f) +
r (f + h) = 2 r h + r w / h adapter parameters, its inner (f) sides r w / h and its outer (h) sides 2 r h; shared:
one expert's worth for the layer; per-expert: every expert's; shared-outer: every expert's inner sides and one pair
of outer sides. An upper bound, within a small factor of what is built; adapters are a small share of the weights
(rank 16 at hidden 2688: under 1.2% of a linear).
"""

from __future__ import annotations


def adapter_bound(memory, hidden: int, experts: int | None, rank: int, layout: str, body: bool,
                  projection: bool) -> float:
    """At most how many adapter parameters a module (`memory`, a ModuleMemory) gets: its layers' when `body`,
    its last part's (an encoder's projection) when `projection`; `layout` the experts' (--lora-experts)."""
    share = 2.0 * rank / hidden
    total = 0.0
    if body:
        for layer in memory.layers:
            total += share * layer.weights.tp + _expert_adapters(layer.weights.expert, hidden, experts, rank, layout)
    if projection:
        total += share * memory.last.weights.tp
    return total


def _expert_adapters(weights: float, hidden: int, experts: int | None, rank: int, layout: str) -> float:
    """A layer's routed experts' adapter parameters, from their weights' count (all experts: whole, unsharded)."""
    if not weights:
        return 0.0
    count = max(experts or 1, 1)
    inner, outer = rank * weights / hidden, 2.0 * rank * hidden  # every expert's inner sides; one expert's outer
    if layout == "per-expert":
        return inner + outer * count
    if layout == "shared-outer":
        return inner + outer
    return inner / count + outer  # shared: one expert's adapter for all
