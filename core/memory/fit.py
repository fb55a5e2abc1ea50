"""`--gpu-memory`: a plan whose largest per-rank estimate (estimate.py) does not fit is refused before any
process group exists, by `mimo plan` and `mimo run`, in one line that says what would help.

The limit is `--gpu-memory`, else the visible GPU's total memory, else 80 GiB. A run on the CPU (`--device cpu`,
or `auto` without a visible GPU) is checked only against an explicit `--gpu-memory`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess

from mimo.errors import UsageError

from . import estimate as memory
from ..parallel import topology
from .estimate import GIB, RankEstimate

DEFAULT_GIB = 80.0


def estimate_plan(plan) -> list[RankEstimate] | None:
    """The plan's per-rank estimates, or None when the provider has no `module_memory` hook."""
    described = plan.hooks.module_memory(settings=plan.settings)
    if described is None:
        return None
    missing = sorted(set(plan.parallelism) - set(described))
    if missing:
        raise UsageError(f"provider '{plan.config.provider}': module_memory describes no module '{missing[0]}'")
    rows = encoder_rows(plan.parallelism, plan.config.training.micro_batch_size)
    return memory.estimate(described, plan.parallelism, memory.options_of(plan), rows)


def adapter_bounds(plan) -> dict[str, int] | None:
    """{module: at most how many adapter parameters it gets} of a LoRA plan, as the memory estimate counts them
    from the provider's module_memory (core/adapters/size.py); None without adapters or without that hook."""
    described = plan.hooks.module_memory(settings=plan.settings) if plan.adapter_targets else None
    if described is None:
        return None
    adapters = memory.options_of(plan).adapters
    return {name: round(memory.adapter_count(name, described[name], adapters)) for name in plan.parallelism}


def encoder_rows(parallelism, micro_batch_size: int) -> dict[str, int]:
    """Samples per micro-batch each encoder's ranks read (their lanes, or their share of one)."""
    return {name: topology.data_positions(parallelism, par.first_rank, micro_batch_size)[1]
            for name, par in parallelism.items() if name != topology.LANGUAGE}


@functools.lru_cache(maxsize=1)
def visible_gpu_gib() -> float | None:
    """Total memory of the first GPU this process may use: nvidia-smi's (it leaves CUDA untouched in the launcher
    and in workers that have not picked their device yet), else torch's; None without either. Asked once."""
    if shutil.which("nvidia-smi"):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        select = ["-i", visible] if visible else []
        try:
            out = subprocess.run(["nvidia-smi", *select, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10)
            first = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
            if first:
                return float(first) / 1024  # MiB
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GIB
    except Exception:  # noqa: BLE001 - a broken CUDA install: no GPU to plan for
        pass
    return None


def gpu_limit_gib(config, planning: bool = False) -> tuple[float, str] | None:
    """(limit in GiB, where it comes from), or None when nothing is enforced: a CPU run without --gpu-memory.
    `--device auto` without a visible GPU is a CPU run for `mimo run`; `mimo plan` (`planning`) then plans for
    GPUs of the default size."""
    if config.memory.gpu_memory is not None:
        return config.memory.gpu_memory, "--gpu-memory"
    if config.training.device == "cpu":
        return None
    visible = visible_gpu_gib()
    if visible is not None:
        return visible, "the visible GPU"
    if config.training.device == "auto" and not planning:
        return None
    return DEFAULT_GIB, "default"


def fits(plan, planning: bool = False) -> bool:
    """Whether the plan's largest rank estimate is within the limit (True when nothing is enforced)."""
    limit = gpu_limit_gib(plan.config, planning)
    estimates = estimate_plan(plan) if limit is not None else None
    return not estimates or max(r.total for r in estimates) <= limit[0] * GIB


def check(plan, estimates: list[RankEstimate] | None = None, planning: bool = False) -> None:
    """Raise UsageError (one line) when the largest rank estimate exceeds the limit."""
    limit = gpu_limit_gib(plan.config, planning)
    estimates = estimate_plan(plan) if estimates is None else estimates
    if limit is None or not estimates:
        return
    gib, source = limit
    worst = max(estimates, key=lambda r: r.total)
    if worst.total <= gib * GIB:
        return
    term, module, size = worst.largest()
    varying = plan.config.memory.image_patches == "max" and _images_vary(plan)
    raise UsageError(
        f"memory: {worst.kind} {worst.ranks[0]}-{worst.ranks[1]} need about {worst.total / GIB:.1f} GiB per GPU"
        f"{' with every image at its largest' if varying else ''}, above the {gib:.0f} GiB limit ({source}); "
        f"largest term: {module} {term} {size / GIB:.1f} GiB; {advice(plan, term, module)} (mimo plan --suggest "
        f"--gpus N lists layouts that fit){_with_mean_images(plan, gib) if varying else ''}")


def _images_vary(plan) -> bool:
    """Whether an encoder's average sample has fewer tokens than its largest (images of varying size)."""
    described = plan.hooks.module_memory(settings=plan.settings) or {}
    return any(m.mean_tokens_per_sample is not None and m.mean_tokens_per_sample < m.tokens_per_sample
               for name, m in described.items() if name != topology.LANGUAGE)


def _with_mean_images(plan, gib: float) -> str:
    """What the estimate says with images of the provider's average size, when that fits (--image-patches)."""
    options = dataclasses.replace(memory.options_of(plan), encoder_tokens="mean")
    rows = encoder_rows(plan.parallelism, plan.config.training.micro_batch_size)
    described = plan.hooks.module_memory(settings=plan.settings)
    mean = max(r.total for r in memory.estimate(described, plan.parallelism, options, rows))
    if mean > gib * GIB:
        return ""
    return (f"; with images of the provider's average size it needs about {mean / GIB:.1f} GiB: --image-patches "
            f"mean accepts that (a batch of larger images can then run out of memory), --image-patches N sets "
            f"your data's image tokens per sample")


def advice(plan, term: str, module: str) -> str:
    """What would shrink `term` of `module` in this plan."""
    config, par = plan.config, plan.parallelism[module]
    shape = plan.shapes[module]
    who = "--llm" if module == topology.LANGUAGE else "--encoder"
    helps = []
    if term == "activations":
        if config.performance.recompute_for(module) != "full":
            helps.append(f"--recompute {module}=full")
        if module != topology.LANGUAGE and plan.step_encoders:
            helps.append("--encoder-pass micro-batch")
        if config.training.micro_batch_size > 1:
            helps.append("a smaller --micro-batch-size")
        helps.append(f"more {who}-tp" + (" with --sequence-parallel" if module == topology.LANGUAGE else ""))
        if module == topology.LANGUAGE:
            helps.append("--llm-pp")
    else:
        if term in ("optimizer",) and not config.optimizer.use_distributed_optimizer:
            helps.append("--use-distributed-optimizer")
        if term in ("optimizer", "gradients"):
            # bf16 moments and gradients (the precision-aware optimizer: GPU, bf16, distributed optimizer)
            if (config.training.precision == "bf16" and config.training.device != "cpu"
                    and config.optimizer.optimizer_precision != "bf16"):
                helps.append("--optimizer-precision bf16")
            if not config.adapters.enabled:
                helps.append("--lora-rank 16 (adapters instead of full fine-tuning)")
        if shape.num_experts and par.ep < shape.num_experts:
            helps.append("more --llm-ep")
        helps.append(f"more {who}-tp")
        if module == topology.LANGUAGE:
            helps.append("--llm-pp")
        if term == "optimizer" and config.optimizer.use_distributed_optimizer:
            helps.append("more data-parallel ranks")
    return "try " + ", ".join(helps) + ", or more GPUs"


def out_of_memory(plan, iteration: int, device) -> str:
    """The one line a run that ran out of GPU memory ends with: where, how much, and what lowers it."""
    import torch

    total = torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else None
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    where = f" (peak {peak:.1f} of {total:.0f} GiB)" if peak is not None and total else ""
    encoders = [name for name in plan.parallelism if name != topology.LANGUAGE]
    helps = advice(plan, "activations", encoders[0] if encoders and plan.pack_image_tokens else topology.LANGUAGE)
    if plan.pack_image_tokens:
        helps = (f"lower --pack-image-tokens (packed rows carry up to {plan.pack_image_tokens} image tokens), "
                 f"{helps[len('try '):]}")
    return (f"out of GPU memory in iteration {iteration}{where}, which the memory plan did not foresee: "
            f"{helps}; `mimo plan` with the same options shows the estimate")


def summary(estimates: list[RankEstimate] | None, limit: tuple[float, str] | None) -> dict | None:
    """The estimate for `mimo plan --json`: GiB per term for each kind of rank."""
    if estimates is None:
        return None
    gib = limit[0] if limit else None
    ranks = []
    for r in estimates:
        ranks.append({
            "kind": r.kind, "ranks": list(r.ranks),
            **{t: r.term(t) / GIB for t in memory.TERMS},
            "allowance": r.allowance / GIB, "allocated": r.allocated / GIB, "total": r.total / GIB,
            "headroom": gib - r.total / GIB if gib else None, "fits": gib is None or r.total <= gib * GIB,
            "modules": [{"module": m.module, "stage": m.stage, "layers": m.layers, "recompute": m.recompute,
                         "tokens_per_micro_batch": m.tokens, "micro_batches_in_flight": m.in_flight,
                         "parameters_per_rank": round(m.parameter_count),
                         **{t: getattr(m, t) / GIB for t in memory.TERMS}} for m in r.modules],
        })
    return {"unit": "GiB", "limit": gib, "limit_source": limit[1] if limit else None, "ranks": ranks,
            "allowance_rule": f"{memory.CONTEXT_BYTES / GIB:.0f} GiB + {memory.ALLOCATOR_SHARE:.0%} of the rest"}
