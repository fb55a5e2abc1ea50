"""A provider's model with the kit's grouped_mm experts beside one with megatron-core's, for the grouped-experts tests
of each family (test_grouped_mm_moe.py, test_qwen35_grouped_mm.py): how they are built, their checkpoint keys, and
one batch through both."""

from __future__ import annotations

import torch

CPU = torch.device("cpu")


def build(provider: str, expert_gemm: str):
    """(plan, world, model) of `provider` with `expert_gemm`, on the CPU, micro-batch 2, in a world of one."""
    from mimo.core.config import RunConfig, TrainingOptions
    from mimo.core.run.plan import prepare
    from mimo.core.run.world import join

    plan = prepare(RunConfig(provider=provider, provider_settings=[f"expert_gemm={expert_gemm}"],
                             training=TrainingOptions(device="cpu", micro_batch_size=2)), world_size=1)
    run = join(plan)
    return plan, run, run.build_model()


def sharded_keys(sharded) -> list:
    """The sharded checkpoint's (key, global shape) entries, sorted."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return sorted((entry.key, tuple(getattr(entry, "global_shape", ()) or ()))
                  for entry in nested_values(sharded) if isinstance(entry, ShardedBase))


def forward_backward_pair(plan, run, grouped, megatron, monkeypatch) -> tuple[int, list]:
    """(how many times the grouped kernel ran, [(output, {parameter: main_grad}) for grouped, megatron]) for the
    plan's first synthetic batch in fp32; the kernel's calls are counted, so that a fallback to the parent's
    forward cannot pass for the grouped one."""
    from mimo.core.forward.batch_transfer import to_device
    from mimo.plugins.kit import grouped_mm_moe

    batch = next(iter(plan.hooks.data_provider(settings=plan.settings, ctx=run.data_context())))
    calls = []
    kernel = grouped_mm_moe.grouped_experts
    monkeypatch.setattr(grouped_mm_moe, "grouped_experts", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    results = []
    for model in (grouped, megatron):
        model.zero_grad_buffer()
        inputs = to_device({k: v for k, v in batch.items() if k != "modality_inputs"}, CPU, torch.float32)
        modality = to_device(batch["modality_inputs"], CPU, torch.float32)
        output, _ = model(**inputs, modality_inputs=modality or None)
        output.sum().backward()
        results.append((output.detach(), {n: p.main_grad.clone() for n, p in model.named_parameters()
                                          if p.requires_grad}))
    return len(calls), results
