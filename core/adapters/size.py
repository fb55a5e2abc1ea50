"""How many adapter parameters a module gets, bounded from its memory description alone: the memory plan builds no
model and does not know which layer holds which linear.

An adapter of rank r on a linear [out, in] holds r (in + out) parameters, at most 2r / h of the linear's in x out
when both sides are at least the module's hidden size h. The plan therefore counts 2r / h of the module's
tensor-parallel weights (its linears and embeddings) in its layers (when the module is a target) and in its last
stage's part (the projection, when `projection` is a target), and of its routed experts' weights: all of them with
an adapter per expert, one expert's worth when the experts share one. An upper bound, within a small factor of what
is built; adapters are a small share of the weights (rank 16 at hidden 2688: under 1.2% of a linear).
"""

from __future__ import annotations


def adapter_bound(memory, hidden: int, experts: int | None, rank: int, per_expert: bool, body: bool,
                  projection: bool) -> float:
    """At most how many adapter parameters a module (`memory`, a ModuleMemory) gets: its layers' when `body`,
    its last part's (an encoder's projection) when `projection`."""
    share = 2.0 * rank / hidden
    total = 0.0
    if body:
        for layer in memory.layers:
            expert = layer.weights.expert if per_expert else layer.weights.expert / max(experts or 1, 1)
            total += share * (layer.weights.tp + expert)
    if projection:
        total += share * memory.last.weights.tp
    return total
