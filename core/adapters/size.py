"""How many adapter parameters a module gets, bounded from its memory description alone: the memory plan builds no
model and does not know which layer holds which linear.

An adapter of rank r on a linear [out, in] holds r (in + out) parameters, at most 2r / h of the linear's in x out
when both sides are at least the module's hidden size h. The plan therefore counts 2r / h of the module's
tensor-parallel weights (its linears and embeddings) in its layers (when the module is a target) and in its last
stage's part (the projection, when `projection` is a target), and of its routed experts' weights: all of them with
an adapter per expert, one expert's worth when the experts share one. shared-outer is counted exactly: each
expert's own halves (fc1's B, fc2's A: rank x its ffn sizes) are r / h of its weights, the layer's two shared halves
r h each. An upper bound, within a small factor of what is built; adapters are a small share of the weights (rank 16
at hidden 2688: under 1.2% of a linear).
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
    """A layer's routed experts' adapter parameters, from their weights' count."""
    if not weights:
        return 0.0
    if layout == "shared-outer":
        return rank * weights / hidden + 2.0 * rank * hidden
    return 2.0 * rank / hidden * weights / (1 if layout == "per-expert" else max(experts or 1, 1))
