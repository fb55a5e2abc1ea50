"""Routed-expert adapters in a PEFT adapter folder: transformers keeps a MoE layer's experts as 3-D parameters
[experts, out, in] of one module (nemotron_h: `mixer.experts.up_proj`, `down_proj`), which PEFT adapts through
`LoraConfig(target_parameters=...)` with one `ParamWrapper` per parameter (peft/tuners/lora/layer.py). Its layout,
for E experts of rank r:

* `lora_A.weight` [r E, in]: expert-major rows, expert e's A at rows e r .. e r + r.
* `lora_B.weight` [out, r E]: rank-major columns, expert e's column k at k E + e.
* each expert's delta `(alpha / r) B_e A_e`, the 3-D parameter taken as [E, out, in] (not transposed).
* several parameters of one module nest their wrappers in the module's parameter order, the last outermost: the
  adapter tensors of the first of two are `...experts.base_layer.lora_A.weight`, of the second
  `...experts.lora_A.weight`.

mimo's per-expert adapters map onto this exactly (same rank, same alpha / r); shared ones are the same A and B for
every expert, written once per expert. PEFT refuses dropout on parameters (`lora_dropout` must be 0 where any
parameter is targeted): an inference-time difference of none.
"""

from __future__ import annotations

import torch

from mimo.errors import UsageError
from mimo.plugins.kit.tensor_map import LoadedModule


def expert_tensors(rows: dict[LoadedModule, tuple[torch.Tensor, torch.Tensor]],
                   ) -> tuple[list[str], dict[str, torch.Tensor]]:
    """`rows`: for each expert row of a 3-D parameter (a LoadedModule with `parameter` and `expert`), that expert's
    (A [r, in], B [out, r]). Returns PEFT's target_parameters and its adapter tensors (adapter-file names)."""
    grouped: dict[tuple[str, str], dict[int, tuple]] = {}
    order: dict[str, tuple[str, ...]] = {}
    for module, pair in rows.items():
        grouped.setdefault((module.path, module.parameter), {})[module.expert] = pair
        order[module.path] = module.parameters or (module.parameter,)
    adapted = {path: [p for p in order[path] if (path, p) in grouped] for path in order}
    targets, tensors = [], {}
    for (path, parameter), experts in sorted(grouped.items()):
        if sorted(experts) != list(range(len(experts))):
            missing = sorted(set(range(max(experts) + 1)) - set(experts))
            raise UsageError(f"--adapter-only: {path}.{parameter} has adapters for some experts only (none for "
                             f"expert {missing[0]}); PEFT adapts every expert of a 3-D parameter")
        a, b = stack(*zip(*(experts[e] for e in range(len(experts)))))
        nesting = "base_layer." * (len(adapted[path]) - 1 - adapted[path].index(parameter))
        targets.append(f"{path}.{parameter}")
        tensors[f"base_model.model.{path}.{nesting}lora_A.weight"] = a
        tensors[f"base_model.model.{path}.{nesting}lora_B.weight"] = b
    return targets, tensors


def stack(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts' A_e [r, in] and B_e [out, r] as PEFT's lora_A [r E, in] (expert-major) and lora_B [out, r E]
    (column k E + e)."""
    lora_a = torch.cat(a, dim=0)
    lora_b = torch.stack(b, dim=-1)  # [out, r, E]: flattening the last two gives column k E + e
    return lora_a.contiguous(), lora_b.reshape(lora_b.shape[0], -1).contiguous()

