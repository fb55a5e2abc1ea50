"""A plan's modules and batch as the step-time estimate reads them: FLOPs from the provider's `model_flops`,
parameters and tokens per sample from its `module_memory`, the batch and recomputation from the memory
estimate's options (core/memory/estimate.py), so a layout is timed as it was sized."""

from __future__ import annotations

from ..memory.estimate import Options
from ..parallel.layout import Layout
from .model import ModuleWork, StepInputs


def forward_flops(plan) -> dict[str, float] | None:
    """{module: forward FLOPs per sample}, or None when the provider has no `model_flops` (or it names a module
    the plan does not have, or leaves one out: then nothing can be timed)."""
    flops = plan.hooks.model_flops(settings=plan.settings)
    if not flops or set(flops) != set(plan.parallelism):
        return None
    return {name: float(value) for name, value in flops.items()}


def modules_of(plan, flops: dict[str, float], described: dict | None, frozen=frozenset()) -> dict[str, ModuleWork]:
    """Each module's work; `described` is the provider's `module_memory` (parameters and tokens), else the shapes'
    parameter counts with every parameter dense."""
    out = {}
    for name, shape in plan.shapes.items():
        memory = (described or {}).get(name)
        if memory is not None:
            w = memory.weights
            dense, experts = w.tp + w.replicated, w.expert
            tokens = memory.mean_tokens_per_sample if memory.mean_tokens_per_sample is not None \
                else memory.tokens_per_sample
        else:
            dense, experts, tokens = shape.num_parameters or 0, 0, 0
        out[name] = ModuleWork(forward_flops=flops[name], dense_parameters=dense, expert_parameters=experts,
                               tokens_per_sample=tokens, hidden_size=shape.hidden_size, layers=shape.num_layers,
                               trainable=name not in frozen, routed_copies=routed_copies(shape, memory),
                               attention_layers=attention_layers(shape, memory),
                               kv_values=2 * shape.hidden_size * (shape.num_query_groups or shape.num_attention_heads)
                               / shape.num_attention_heads)
    return out


def attention_layers(shape, memory) -> int:
    """The layers with attention: module_memory's of kind attention or transformer, else every layer."""
    if memory is None:
        return shape.num_layers
    return sum(1 for layer in memory.layers if layer.kind in ("attention", "transformer"))


def routed_copies(shape, memory) -> float:
    """MoE layers x experts per token, from what the provider reports: each expert's parameters (module_memory's
    routed weights over the experts) and the parameters a token does not reach (the shape's total less its
    active count) give the experts per token; module_memory's layers of kind `moe` count the MoE layers. 0 where
    either is missing."""
    if memory is None or not shape.num_experts or not memory.weights.expert or not shape.num_active_parameters:
        return 0.0
    per_expert = memory.weights.expert / shape.num_experts
    per_token = shape.num_experts - (shape.num_parameters - shape.num_active_parameters) / per_expert
    return max(per_token, 0.0) * sum(1 for layer in memory.layers if layer.kind == "moe")


def step_inputs(modules: dict[str, ModuleWork], parallelism: dict, options: Options) -> StepInputs:
    """The estimate's inputs for a layout sized with memory `options`."""
    encoders_apart = not Layout(parallelism).colocated
    return StepInputs(modules=modules, parallelism=parallelism, micro_batch_size=options.micro_batch_size,
                      num_microbatches=options.num_microbatches, recompute=dict(options.recompute),
                      step_encoders=options.step_encoders and not encoders_apart,
                      distributed_optimizer=options.distributed_optimizer)
