"""`mimo plan`'s per-rank memory estimate against the peaks recorded on several GPUs (docs/benchmarks/
layouts_slice.json) and the slice's one-GPU peak (docs/benchmarks/slice_h100.json), encoder and LLM ranks apart.

The estimate holds every image at its largest (max_patches); the recorded runs drew their images' patches at
random (256 to max_patches), so only ranks whose memory does not depend on the images can be checked within 5%:
the LLM ranks of a split. On the ranks that hold the encoders the recorded peak must lie between the estimate with
the provider's average images and the one with the largest. The runs with every image at one size
(`patches_per_image`: ids ending in -1img/-2img) are checked within 5% on every rank."""

from __future__ import annotations

import dataclasses
import json

import pytest

from helpers import REPO
from mimo.core.memory import estimate as memory
from mimo.core.memory import fit
from test_step_time import fit_script

GIB = 2 ** 30
RECORDS = {r["id"]: r for r in json.loads((REPO / "docs/benchmarks/layouts_slice.json").read_text())["runs"]}


def estimates(record: dict, images: str = "max") -> dict[str, float]:
    """{rank kind: allocated GiB} of `mimo plan` for a recorded run (the sum of the terms: what torch's
    max_memory_allocated measures; the allowance covers what the allocator reserves besides)."""
    plan = fit_script().plan_of(record["provider"], record["settings"], record["gpus"], record["layout_options"],
                                record["micro_batch_size"], record.get("num_microbatches"),
                                record.get("global_batch_size"), record["gpu_memory_gib"],
                                record.get("cuda_graphs", True))
    options = dataclasses.replace(memory.options_of(plan), encoder_tokens=images)
    rows = fit.encoder_rows(plan.parallelism, plan.config.training.micro_batch_size)
    ranks = memory.estimate(plan.hooks.module_memory(settings=plan.settings), plan.parallelism, options, rows)
    return {r.kind: r.allocated / GIB for r in ranks}


def test_llm_ranks_of_the_split_within_5_percent_of_their_recorded_peak():
    record = RECORDS["slice-split-ep3"]
    measured = record["peak_memory_gib"]["LLM ranks"]
    assert estimates(record)["LLM ranks"] == pytest.approx(measured, rel=0.05)
    # the LLM ranks hold no image: the images' size does not move them
    assert estimates(record, "mean")["LLM ranks"] == estimates(record)["LLM ranks"]


def test_llm_ranks_with_weights_drawn_on_the_gpus_within_5_percent():
    """RADIO on rank 0 and the LLM DP3 on 4 H200s, weights drawn on the GPUs (call E): the LLM ranks peaked at
    33.4 GiB. Runs with CPU-drawn weights peaked about 1.2 GiB higher on the same work then (the routed experts'
    stacked copies, since laid out again: plugins/kit/grouped_mm_moe.py), and the plan had been fitted to them
    with the experts' outputs counted as kept, which they are not: 35.7 planned until both were found in a memory
    snapshot (scripts/memory_at_peak.py)."""
    record = RECORDS["slice-split-1+3"]
    measured = record["peak_memory_gib"]["LLM ranks"]
    assert estimates(record)["LLM ranks"] == pytest.approx(measured, rel=0.05)


def test_the_slice_on_one_gpu_within_5_percent_of_its_recorded_peak():
    """slice_h100.json's runs of the in-place loss (the code of the several-GPU runs): 49.4 GiB."""
    rows = json.loads((REPO / "docs/benchmarks/slice_h100.json").read_text())["rows"]
    measured = min(r["peak_memory_gib"] for r in rows if r.get("peak_memory_gib"))
    record = {**RECORDS["slice-1xH100"]}
    assert estimates(record)["all ranks"] == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("run, kind", [("slice-ep4", "all ranks"), ("slice-split-ep3", "encoder ranks"),
                                       ("mid-ep4", "all ranks"), ("slice-dp4", "all ranks"),
                                       ("slice-ep4-64x4", "all ranks")])
def test_ranks_with_images_lie_between_average_and_largest_images(run, kind):
    record = RECORDS[run]
    measured = record["peak_memory_gib"][kind]
    assert estimates(record, "mean")[kind] < measured < estimates(record)[kind]


EXACT_IMAGES = [(run, kind) for run, r in RECORDS.items() if r["settings"].get("patches_per_image")
                for kind in r.get("peak_memory_gib", {})]


@pytest.mark.parametrize("run, kind", EXACT_IMAGES)
def test_runs_with_images_of_one_size_within_5_percent_on_every_rank(run, kind):
    assert len(EXACT_IMAGES) >= 7  # two colocated runs with EP and without, two splits' encoder and LLM ranks
    assert estimates(RECORDS[run])[kind] == pytest.approx(RECORDS[run]["peak_memory_gib"][kind], rel=0.05)


CONTEXT_PARALLEL = json.loads((REPO / "docs/benchmarks/context_parallel_gpu.json").read_text())


@pytest.mark.parametrize("record", [r for r in CONTEXT_PARALLEL["runs"] if r["id"] != "slice-dp2-8k-2img-8mb"],
                         ids=lambda r: r["id"])
def test_the_slice_at_32k_tokens_with_and_without_context_parallelism_within_5_percent(record):
    """The plan counts the LLM's activations per CP rank: CP 2 and CP 1 at sequence 32768
    (context_parallel_gpu.json)."""
    assert estimates(record)["all ranks"] == pytest.approx(record["peak_memory_gib"]["all ranks"], rel=0.05)


def test_the_8k_baseline_of_the_cp_comparison_within_5_percent():
    """The CP comparison's 8192-token DP 2 run (weights drawn on the GPUs) peaked at 55.0 GiB, and so did the same
    work on one H200 with its allocator recorded, drawn on the GPU or (after the experts' relayout) on the CPU
    (scripts/gpu/slice_layouts.sh diagnose / remeasure). The plan said 58.8 before it left out the experts' outputs
    and stopped adding RADIO's recomputed layer to the LLM's activations (they are never held at once)."""
    record = next(r for r in CONTEXT_PARALLEL["runs"] if r["id"] == "slice-dp2-8k-2img-8mb")
    assert estimates(record)["all ranks"] == pytest.approx(record["peak_memory_gib"]["all ranks"], rel=0.05)


def test_cp_2_matched_cp_1_on_two_gpus():
    """The recorded CP 2 runs gave CP 1's losses and gradient norms: fp32 within 1e-6, bf16 within bf16's noise."""
    tolerance = {"mock_local_fp32": (1e-6, 1e-6), "mock_te_bf16": (1e-4, 1e-2), "nemotron_tiny_te_bf16": (1e-4, 1e-2),
                 "nemotron_tiny_te_bf16_heterogeneous": (1e-4, 1e-2), "nemotron_tiny_te_bf16_packed": (1e-4, 1e-2)}
    for check in CONTEXT_PARALLEL["checks"]:
        loss, grad = tolerance[check["id"]]
        assert len(check["cp1"]) == len(check["cp2"]) == 10
        for (i, loss1, grad1), (j, loss2, grad2) in zip(check["cp1"], check["cp2"]):
            assert i == j and loss2 == pytest.approx(loss1, rel=loss) and grad2 == pytest.approx(grad1, rel=grad)


def test_the_whole_model_on_four_gpus_within_5_percent():
    """RADIO-H + the released 52-layer LLM (31.6B parameters) with EP4, full recompute and the precision-aware
    optimizer on four H200s (layouts_gpu.json `four_gpus`): 97.1 GiB at most, against the plan's 93.8 then; 92.9
    since (RADIO's recomputed layer no longer counted beside the LLM's activations, the experts' outputs not kept,
    their stacked copy under the distributed optimizer counted)."""
    from mimo.core.config import (LaunchOptions, LayoutOptions, MemoryOptions, OptimizerOptions, PerformanceOptions,
                                  RunConfig, TrainingOptions)
    from mimo.core.run.plan import prepare

    record = next(r for r in json.loads((REPO / "docs/benchmarks/layouts_gpu.json").read_text())["four_gpus"]["runs"]
                  if r["name"] == "full-ep4")
    config = RunConfig(provider=record["provider"],
                       provider_settings=[f"{k}={v}" for k, v in record["settings"].items()],
                       launch=LaunchOptions(nproc_per_node=4), layout=LayoutOptions(llm_ep=4),
                       training=TrainingOptions(micro_batch_size=1, num_microbatches=8, device="cuda",
                                                precision="bf16"),
                       optimizer=OptimizerOptions(use_distributed_optimizer=True, optimizer_precision="bf16"),
                       performance=PerformanceOptions(recompute="full"), memory=MemoryOptions(gpu_memory=139.8))
    plan = prepare(config, world_size=4)
    rows = fit.encoder_rows(plan.parallelism, plan.config.training.micro_batch_size)
    ranks = memory.estimate(plan.hooks.module_memory(settings=plan.settings), plan.parallelism,
                            memory.options_of(plan), rows)
    assert [r.kind for r in ranks] == ["all ranks"]
    assert ranks[0].allocated / GIB == pytest.approx(max(record["peak_memory_gib"]), rel=0.05)
    assert ranks[0].allocated / GIB == pytest.approx(92.93, abs=0.05)


LORA = {r["id"]: r for r in json.loads((REPO / "docs/benchmarks/lora_gpu.json").read_text())["runs"]}


@pytest.mark.parametrize("run, targets", [
    ("slice-lora16-no-routed-experts-2026-11-29", "language:linear_qkv,linear_proj,in_proj,out_proj,shared_experts"),
    ("slice-full-finetune-2026-11-29", None)])
def test_lora_and_full_fine_tuning_on_one_gpu_within_5_percent(run, targets):
    """lora_gpu.json: LoRA keeps no activations in the frozen encoder (nothing there trains) and no inputs of the
    frozen routed experts' GEMMs (their weights get no gradient): 10.8 GiB measured; full fine-tuning 70.0 (measured
    again after the expert weights' relayout on a move: 12.0 and 71.2 before, the forward's stacked copies)."""
    from mimo.core.config import AdapterOptions, MemoryOptions, RunConfig, TrainingOptions
    from mimo.core.run.plan import prepare

    record = LORA[run]
    settings = dict(hybrid_pattern="MEMEM*EMEM", num_experts=16, backend="te", images_per_sample=1,
                    patches_per_image=4096)
    for key, value in settings.items():  # the recorded command is the one this test plans
        assert f"{key}={value}" in record["command"]
    assert (targets is None) == ("--lora-rank" not in record["command"])
    config = RunConfig(provider="nemotron-moe-vlm-52l", provider_settings=[f"{k}={v}" for k, v in settings.items()],
                       training=TrainingOptions(micro_batch_size=1, num_microbatches=4, device="cuda",
                                                precision="bf16"),
                       adapters=AdapterOptions(lora_rank=16, lora_targets=targets) if targets else AdapterOptions(),
                       memory=MemoryOptions(gpu_memory=139.8))
    plan = prepare(config, world_size=1)
    rows = fit.encoder_rows(plan.parallelism, plan.config.training.micro_batch_size)
    [rank] = memory.estimate(plan.hooks.module_memory(settings=plan.settings), plan.parallelism,
                             memory.options_of(plan), rows)
    assert rank.allocated / GIB == pytest.approx(record["peak_memory_gib"], rel=0.05)


def test_the_whole_model_with_adapters_on_one_gpu_within_5_percent():
    """lora_gpu.json full-lora16: RADIO-H + the released 52-layer LLM with adapters on the default targets (experts
    included) at sequence 4096 on one H200: 118.1 GiB measured, the plan 120.0."""
    from mimo.core.config import AdapterOptions, MemoryOptions, RunConfig, TrainingOptions
    from mimo.core.run.plan import prepare

    record = LORA["full-lora16"]
    settings = dict(backend="te", images_per_sample=1, patches_per_image=4096, seq_length=4096)
    for key, value in settings.items():  # the recorded command is the one this test plans
        assert f"{key}={value}" in record["command"]
    config = RunConfig(provider="nemotron-moe-vlm-52l", provider_settings=[f"{k}={v}" for k, v in settings.items()],
                       training=TrainingOptions(micro_batch_size=1, num_microbatches=8, device="cuda",
                                                precision="bf16"),
                       adapters=AdapterOptions(lora_rank=16), memory=MemoryOptions(gpu_memory=139.8))
    plan = prepare(config, world_size=1)
    rows = fit.encoder_rows(plan.parallelism, plan.config.training.micro_batch_size)
    ranks = memory.estimate(plan.hooks.module_memory(settings=plan.settings), plan.parallelism,
                            memory.options_of(plan), rows)
    assert ranks[0].allocated / GIB == pytest.approx(record["peak_memory_gib"], rel=0.05)
