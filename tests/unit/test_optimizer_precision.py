"""--optimizer-precision where a CPU can check it: the refusals (one line, before any process), megatron-core's
OptimizerConfig fields it sets, the gradient buffers' dtype, and what the memory plan counts. The precision-aware
optimizer itself runs on GPUs only (transformer-engine's FusedAdam): docs/benchmarks/layouts_gpu.json `four_gpus`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mimo.core.config import OptimizerOptions, RunConfig, TrainingOptions
from mimo.core.memory import estimate
from mimo.core.parallel import optim
from mimo.errors import UsageError


@pytest.mark.parametrize("training, distributed, missing", [
    (TrainingOptions(precision="fp32", device="cuda"), True, "--precision bf16"),
    (TrainingOptions(precision="bf16", device="cuda"), False, "--use-distributed-optimizer"),
    (TrainingOptions(precision="bf16", device="cpu"), True, "a GPU (--device cuda)"),
])
def test_refused_in_one_line_naming_what_is_missing(training, distributed, missing):
    config = RunConfig(provider="mock-vlm", training=training, optimizer=OptimizerOptions(
        optimizer_precision="bf16-moments", use_distributed_optimizer=distributed))
    with pytest.raises(UsageError) as err:
        config.validate()
    line = str(err.value)
    assert line.startswith("--optimizer-precision bf16-moments needs ") and missing in line and "\n" not in line


def test_fp32_is_the_default_and_needs_nothing():
    RunConfig(provider="mock-vlm").validate()
    assert OptimizerOptions().optimizer_precision == "fp32" and optim.precision_aware("fp32") == {}


def test_without_transformer_engine_a_usage_error_not_megatrons(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_te(name, *args, **kwargs):
        if name.startswith("transformer_engine"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_te)
    with pytest.raises(UsageError, match=r"needs transformer-engine's FusedAdam.*pip install '\.\[te\]'"):
        optim.precision_aware("bf16")


def test_the_fields_megatron_core_reads(monkeypatch):
    import sys
    import types

    te_optimizers = types.ModuleType("transformer_engine.pytorch.optimizers")
    te_optimizers.FusedAdam = object
    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.optimizers", te_optimizers)
    moments = optim.precision_aware("bf16-moments")
    assert moments["use_precision_aware_optimizer"] and moments["store_param_remainders"]
    assert (moments["exp_avg_dtype"], moments["exp_avg_sq_dtype"]) == (torch.bfloat16, torch.bfloat16)
    assert moments["main_grads_dtype"] == torch.float32
    assert optim.precision_aware("bf16")["main_grads_dtype"] == torch.bfloat16


def test_memory_plan_bytes_per_parameter():
    base = estimate.Options(bf16=True, distributed_optimizer=True, sequence_parallel=False, micro_batch_size=1,
                            num_microbatches=1, recompute={})
    rows = {p: estimate.optimizer_bytes(dataclasses.replace(base, optimizer_precision=p))
            for p in ("fp32", "bf16-moments", "bf16")}
    # (optimizer state, gradient) bytes: fp32 main weights and moments; bf16 moments and 16-bit remainders
    assert rows == {"fp32": (12, 4), "bf16-moments": (6, 4), "bf16": (6, 2)}
    assert estimate.optimizer_bytes(dataclasses.replace(base, bf16=False)) == (8, 4)


def test_mimo_plan_counts_it():
    from mimo.core.run.plan import prepare

    def planned(precision: str):
        config = RunConfig(provider="mock-vlm", training=TrainingOptions(precision="bf16", device="cuda"),
                           optimizer=OptimizerOptions(use_distributed_optimizer=True, optimizer_precision=precision))
        plan = prepare(config, world_size=1)
        return estimate.options_of(plan).optimizer_precision

    assert planned("bf16") == "bf16" and planned("fp32") == "fp32"


def test_a_full_fine_tune_that_does_not_fit_is_told_the_optimizer_options():
    """The released model on four GPUs without optimizer options: its refusal names the options that make it fit."""
    from mimo.core.config import LaunchOptions, LayoutOptions, MemoryOptions
    from mimo.core.memory import fit
    from mimo.core.run.plan import prepare

    def line(**optimizer) -> str:
        config = RunConfig(provider="nemotron-moe-vlm-54l", launch=LaunchOptions(nproc_per_node=4),
                           layout=LayoutOptions(llm_ep=4), memory=MemoryOptions(gpu_memory=139.8),
                           optimizer=OptimizerOptions(**optimizer),
                           training=TrainingOptions(micro_batch_size=1, num_microbatches=8, device="cuda",
                                                    precision="bf16"))
        return fit.advice(prepare(config, world_size=4), "optimizer", "language")

    assert line().startswith("try --use-distributed-optimizer, --optimizer-precision bf16, --lora-rank 16")
    done = line(use_distributed_optimizer=True, optimizer_precision="bf16")
    assert "--optimizer-precision" not in done and "--use-distributed-optimizer" not in done
