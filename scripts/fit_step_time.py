"""Fit the step-time calibration (core/step_time/calibration.json) to the measured runs, or check it.

    python scripts/fit_step_time.py            # refit and write calibration.json's `fitted` section
    python scripts/fit_step_time.py --check    # exit 1 when the file no longer holds what the records give

Inputs, each read from its record (nothing typed in here but where to find them):
- the optimizer's rate: Adam's kernels in the profiled slice iteration (docs/benchmarks/slice_h100.json `kernels`);
- the H100's speed against the H200: RADIO's graphed forward on the slice, the same code and options on both
  (docs/benchmarks/slice_h100.json `tried`; calibration.json `gpu_speed`);
- the split's per-micro-batch costs: the stage-overlap probe (docs/benchmarks/layouts_gpu.json);
- the four rates (encoder and LLM efficiency, the expert all-to-all, collectives): least squares over the
  colocated slice runs of docs/benchmarks/layouts_slice.json.
Then every measured run and pair is estimated and printed beside its measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECORDS = REPO / "docs" / "benchmarks" / "layouts_slice.json"
PROBE = REPO / "docs" / "benchmarks" / "layouts_gpu.json"
HEAVY = REPO / "docs" / "benchmarks" / "layouts.json"
SLICE = REPO / "docs" / "benchmarks" / "slice_h100.json"
FITTED_FROM = ("slice-1xH100", "slice-dp2-4096", "slice-ep2-4096", "slice-ep4")
# measured pairs of one model and GPU count (the slice's pairs: one machine and call each)
PAIRS = (("slice-dp2-4096", "slice-split-4096"), ("slice-dp2-4096", "slice-ep2-4096"),
         ("slice-ep4", "slice-split-ep3"), ("mid-dp4", "mid-ep4"), ("probe-colocated", "probe-split"),
         ("heavy-colocated", "heavy-split"), ("slice-dp2-2img", "slice-split-2img"),
         ("slice-dp2-2img", "slice-ep2-2img"), ("slice-dp2-1img", "slice-split-1img"),
         ("slice-dp4", "slice-ep4-64x4"), ("slice-dp4-2img", "slice-split-2+2-ep2-2img"),
         ("slice-dp4-e", "slice-split-1+3"))


@dataclasses.dataclass
class Run:
    """A measured run: its plan's step-time inputs and what it took."""

    id: str
    inputs: object  # core.step_time.model.StepInputs
    measured_s: float
    tokens_per_sample: float
    device: str
    estimate: object = None  # core.step_time.model.StepEstimate, once fitted
    speed: float = 1.0  # the device's speed against the calibration's GPU

    def tokens_per_s_per_gpu(self) -> float:
        return self.inputs.global_batch * self.tokens_per_sample / self.measured_s / self.inputs.gpus


def plan_of(provider: str, settings: dict, gpus: int, layout: dict, micro_batch_size: int,
            num_microbatches: int | None, global_batch_size: int | None, gpu_memory: float, cuda_graphs: bool):
    from mimo.core.config import (LaunchOptions, LayoutOptions, MemoryOptions, PerformanceOptions, RunConfig,
                                  TrainingOptions)
    from mimo.core.run.plan import prepare

    cfg = RunConfig(provider=provider, provider_settings=[f"{k}={v}" for k, v in settings.items()],
                    launch=LaunchOptions(nproc_per_node=gpus),
                    training=TrainingOptions(micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
                                             global_batch_size=global_batch_size, device="cuda", precision="bf16"),
                    layout=LayoutOptions(**layout), memory=MemoryOptions(gpu_memory=gpu_memory),
                    performance=PerformanceOptions(cuda_graphs=cuda_graphs))
    return prepare(cfg, world_size=gpus)


def inputs_of(plan):
    from mimo.core.memory import estimate as memory
    from mimo.core.step_time import workload

    options = memory.options_of(plan)
    flops = workload.forward_flops(plan)
    modules = workload.modules_of(plan, flops, plan.hooks.module_memory(settings=plan.settings), options.frozen)
    return workload.step_inputs(modules, plan.parallelism, options), flops


def run_of(id_: str, plan, seconds_of, device: str) -> Run:
    inputs, flops = inputs_of(plan)
    return Run(id_, inputs, seconds_of(inputs, flops), inputs.modules["language"].tokens_per_sample, device)


def recorded_runs() -> dict[str, Run]:
    """Every run of layouts_slice.json, its time from the median TFLOP/s and the provider's FLOPs."""
    runs = {}
    for r in json.loads(RECORDS.read_text())["runs"]:
        plan = plan_of(r["provider"], r["settings"], r["gpus"], r["layout_options"], r["micro_batch_size"],
                       r.get("num_microbatches"), r.get("global_batch_size"), r["gpu_memory_gib"], True)
        median = r["tflops_per_gpu"][1] * 1e12
        runs[r["id"]] = run_of(r["id"], plan, lambda inputs, flops: 3 * sum(flops.values()) * inputs.global_batch /
                               (median * inputs.gpus), r["device"])
    return runs


def _command_run(command: str) -> dict:
    """The options of a recorded `mimo run` command that a plan needs."""
    words = shlex.split(command)
    value = lambda flag, default=None: words[words.index(flag) + 1] if flag in words else default  # noqa: E731
    sets = dict(w.split("=", 1) for f, w in zip(words, words[1:]) if f == "--set")
    return {"provider": value("--provider"), "settings": sets, "gpus": int(value("--nproc-per-node", 1)),
            "micro_batch_size": int(value("--micro-batch-size")),
            "global_batch_size": int(value("--global-batch-size")),
            "encoder_ranks": int(value("--encoder-ranks", 0)), "cuda_graphs": "--cuda-graphs" in words}


def probe_runs() -> tuple[dict[str, Run], dict]:
    """The stage-overlap probe's two runs and the figures the split's overheads are fitted from."""
    probe = json.loads(PROBE.read_text())["stage_overlap_probe"]
    c = _command_run(probe["command"])
    runs, plans = {}, {}
    for id_, encoder_ranks in (("probe-colocated", 0), ("probe-split", 1)):
        plans[id_] = plan_of(c["provider"], c["settings"], c["gpus"], {"encoder_ranks": encoder_ranks},
                             c["micro_batch_size"], None, c["global_batch_size"], 140.4, c["cuda_graphs"])
    colocated = probe["colocated_dp2"]["ms_per_iteration_min_median_max"][1] * 1e-3
    intervals = probe["split_1_plus_1"]["logged_intervals"]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    split = mean([i["ms_per_iteration"] for i in intervals]) * 1e-3
    runs["probe-colocated"] = run_of("probe-colocated", plans["probe-colocated"], lambda i, f: colocated, "NVIDIA H200")
    runs["probe-split"] = run_of("probe-split", plans["probe-split"], lambda i, f: split, "NVIDIA H200")
    flops = inputs_of(plans["probe-colocated"])[1]
    timers = probe["colocated_dp2"]["timers_ms_iteration_30"]["language"]
    busy = lambda module: mean([i["timers_ms"][module]["forward"] + i["timers_ms"][module]["backward"]  # noqa: E731
                                for i in intervals]) * 1e-3
    figures = dict(encoder_share=flops["images"] / sum(flops.values()),
                   colocated_busy_s=(timers["forward"] + timers["backward"]) * 1e-3,
                   colocated_samples_per_gpu=c["global_batch_size"] // c["gpus"],
                   encoder_busy_s=busy("images"), language_busy_s=busy("language"), split_iteration_s=split,
                   split_optimizer_s=max(mean([i["timers_ms"][m]["optimizer"] for i in intervals])
                                         for m in ("images", "language")) * 1e-3,
                   micro_batches=c["global_batch_size"] // c["micro_batch_size"])
    return runs, figures


def heavy_runs() -> dict[str, Run]:
    """docs/benchmarks.md (b): the encoder-heavy mock-vlm, colocated against split, on two H200s."""
    runs = {}
    for row in json.loads(HEAVY.read_text())["rows"]:
        c = _command_run(row["command"])
        plan = plan_of(c["provider"], c["settings"], c["gpus"], {"encoder_ranks": c["encoder_ranks"]},
                       c["micro_batch_size"], None, c["global_batch_size"], 140.4, c["cuda_graphs"])
        id_ = f"heavy-{row['layout'].replace('heterogeneous', 'split')}"
        runs[id_] = run_of(id_, plan, lambda i, f, ms=row["elapsed_ms"]: ms * 1e-3, "NVIDIA H200")
    return runs


def adam_ms(slice_record: dict) -> float:
    """Adam's kernel time in the profiled slice iteration."""
    line = next(t for t in slice_record["kernels"]["top"] if "multi_tensor_adam" in t)
    return float(re.match(r"\s*([\d.]+) ms", line).group(1))


def h100_speed(slice_record: dict) -> float:
    """The H100's speed against the H200 on the slice: RADIO's graphed-forward trial ran on both, each beside
    megatron-core's recompute; the mean of the two ratios of medians."""
    tried = next(t for t in slice_record["tried"] if t.get("setting") == "vision_graphs=forward")["measured"]
    medians = [int(m) for m in re.findall(r"\d+-(\d+)-\d+", tried)]  # H100: graphed, recompute; H200: the same
    h100, h200 = medians[:2], medians[2:4]
    return sum(a / b for a, b in zip(h100, h200)) / 2


def fit(document: dict) -> tuple[dict, dict[str, Run]]:
    """The `fitted` section the records give, and every run."""
    from mimo.core.step_time import calibration, fit as fitting
    from mimo.core.step_time.model import estimate

    runs = recorded_runs()
    probe, figures = probe_runs()
    runs.update(probe)
    runs.update(heavy_runs())
    slice_record = json.loads(SLICE.read_text())
    one_gpu = runs["slice-1xH100"].inputs
    stepped = sum(m.dense_parameters + m.expert_parameters for m in one_gpu.modules.values())
    optimizer = adam_ms(slice_record) / (stepped / 1e9)
    overheads = fitting.probe_overheads(**figures)
    fitted = json.loads(json.dumps(document["fitted"]))  # the provenance stays; the values are replaced
    fitted["optimizer_ms_per_billion_parameters"]["value"] = optimizer
    for name, seconds in overheads.items():
        fitted[name[:-2] + "_ms"]["value"] = seconds * 1e3
    known = calibration.values({**document, "fitted": fitted})
    document["gpu_speed"]["NVIDIA H100 80GB HBM3"]["value"] = round(h100_speed(slice_record), 4)
    speed = {gpu: entry["value"] for gpu, entry in document["gpu_speed"].items()}
    chosen = [runs[i] for i in FITTED_FROM]
    measured = [r.measured_s * speed[r.device] for r in chosen]  # in the reference GPU's time
    rates = fitting.least_squares([fitting.row(r.inputs, known) for r in chosen], measured)
    cal = fitting.with_rates(known, rates)
    fitted["efficiency_encoder"]["value"] = cal.efficiency["encoder"]
    fitted["efficiency_language"]["value"] = cal.efficiency["language"]
    fitted["all_to_all_gb_per_s"]["value"] = cal.all_to_all_bytes_per_s / 1e9
    fitted["collective_gb_per_s"]["value"] = cal.collective_bytes_per_s / 1e9
    for run in runs.values():
        run.estimate = estimate(run.inputs, cal)
        run.speed = speed[run.device]
    return fitted, runs


def report(runs: dict[str, Run]) -> list[str]:
    lines = [f"{'run':18} {'measured ms':>11} {'estimated ms':>12} {'error':>7}  slower stage, largest term"]
    for run in runs.values():
        est, measured = run.estimate, run.measured_s * run.speed
        slowest = est.slowest
        top = max(slowest.terms, key=slowest.terms.get)
        lines.append(f"{run.id:18} {measured * 1e3:11.0f} {est.seconds * 1e3:12.0f} {est.seconds / measured - 1:+7.1%}"
                     f"  {slowest.name}, {top}")
    lines.append("pairs (tokens/s/GPU measured | estimated):")
    for a, b in PAIRS:
        ra, rb = runs[a], runs[b]
        est = lambda r: r.estimate.tokens_per_s_per_gpu(r.tokens_per_sample) * r.speed  # noqa: E731
        lines.append(f"  {a} {ra.tokens_per_s_per_gpu():.0f} | {est(ra):.0f}   {b} {rb.tokens_per_s_per_gpu():.0f} | "
                     f"{est(rb):.0f}")
    return lines


def main() -> int:
    from mimo.core.step_time import calibration

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with calibration.json instead of writing it")
    args = parser.parse_args()
    document = calibration.read()
    fitted, runs = fit(document)
    print("\n".join(report(runs)))
    if args.check:
        stale = [name for name, entry in fitted.items()
                 if abs(entry["value"] - document["fitted"][name]["value"]) > 1e-6 * abs(entry["value"])]
        if stale:
            print(f"calibration.json is stale: {', '.join(stale)} (run scripts/fit_step_time.py)")
            return 1
        return 0
    document["fitted"] = fitted
    calibration.FILE.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {calibration.FILE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
