"""What a run reports, once per log interval, from one rank: the log line (or a progress bar on a terminal),
the metrics file, TensorBoard (Megatron's scalar names), and throughput as tokens/s, TFLOP/s and MFU per GPU
(throughput.py: from what the data counted, padding left out, where it counts)."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path

import torch

from .gc_pauses import GcPauses
from .throughput import Interval, throughput
from .timers import format_timers
from .truncation import DataReport, data_parts

from mimo.wording import counted

# Dense bf16 peak TFLOP/s per GPU, for MFU (override with --peak-tflops).
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "GH200": 989.4, "A100": 312.0, "A800": 312.0,
                    "B200": 2250.0, "B100": 1750.0, "L40S": 362.0, "L40": 181.0, "A10": 125.0}


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS.items() if key in name.split()), None)


class MetricsLogger:
    def __init__(self, options, *, total_iters: int, enabled: bool, global_batch_size: int,
                 tokens_per_iteration: int, flops_per_iteration: float | None, world_size: int, device: torch.device,
                 timers, data_report: DataReport | None = None, data_start=None):
        """`options`: the run's LoggingOptions; `enabled`: this rank logs (one rank of the run);
        `tokens_per_iteration`, `flops_per_iteration`: the global batch's rows x seq_length, and x `model_flops` x 3
        (the figures of data that counts nothing); `data_report`: what --data skipped and cut, per interval;
        `data_start`: what the data had counted when this process began (a DataCounts: a resume's), or None."""
        self.options, self.total_iters, self.enabled = options, total_iters, enabled
        self.global_batch_size = global_batch_size
        self.tokens_per_iteration, self.flops_per_iteration = tokens_per_iteration, flops_per_iteration
        self.world_size, self.device, self.timers = world_size, device, timers
        self.peak = peak_tflops(device, options.peak_tflops)
        self.metrics_file = Path(options.metrics_file) if options.metrics_file and enabled else None
        if self.metrics_file:
            self.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        self.tensorboard = _tensorboard(options.tensorboard_dir) if enabled else None
        self.progress = _progress(total_iters) if enabled and sys.stdout.isatty() else None
        self.records: list[dict] = []
        self.skipped_total = self.nan_total = self.nan_in_a_row = 0
        self.nan_stop: str | None = None  # why the NaN limit stops the run (the loop saves, then stops)
        self.data_report = data_report or DataReport(share=1.0, seq_length=None)
        # the whole run's, for its closing summary: tokens trained (padding left out where the data counts it),
        # the rows' tokens (padding included) and the training time
        self.trained_tokens, self.trained_row_tokens, self.trained_seconds = 0, 0, 0.0
        self._data_before = data_start  # the data's counts at the last record
        self.gc_pauses = GcPauses()
        self._reset()

    def _reset(self):
        self._loss_sum = self._tokens = self._iters = self._loss_tokens = 0
        self._data_wait = 0.0
        self._start = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (an evaluation) out of the interval's time, so throughput counts training alone."""
        self._start += seconds

    def update(self, iteration: int, result, consumed_rows: int) -> dict | None:
        """Account one iteration (on every rank: the NaN limit and the timers are collective). `consumed_rows`:
        the rows (global batches x their size) trained so far; the samples are the data's count where it counts
        them (packed rows hold several), else the rows."""
        consumed_samples = result.data.samples if result.data is not None else consumed_rows
        finite = math.isfinite(result.lm_loss) and (result.grad_norm is None or math.isfinite(result.grad_norm))
        self.nan_in_a_row = 0 if finite else self.nan_in_a_row + 1
        self.nan_total += not finite
        self.skipped_total += result.skipped
        if finite:
            self._loss_sum += result.lm_loss * result.num_tokens
            self._tokens += result.num_tokens
        self._iters += 1
        self._loss_tokens += result.num_tokens
        self._data_wait += getattr(result, "data_wait_s", 0.0)
        if self.tensorboard:
            self._per_iteration_scalars(iteration, result, consumed_samples)
        if self.progress:
            self.progress.advance(self.progress.task_ids[0])
        if self.nan_in_a_row >= self.options.max_nan_iters:
            self.nan_stop = (f"{counted(self.nan_in_a_row, 'iteration')} in a row had a non-finite loss or gradient "
                             f"norm (the last: iteration {iteration}), so training stopped; lower --lr, check the "
                             f"data, or raise --max-nan-iters")
        if iteration % self.options.log_interval and iteration != self.total_iters and not self.nan_stop:
            return None
        timers = self.timers.collect(self._iters)
        record = self._record(iteration, result, consumed_samples, consumed_rows, timers)
        self._reset()
        self.records.append(record)
        if self.enabled:
            self._emit(record, timers)
        return record

    def _record(self, iteration, result, consumed_samples, consumed_rows, timers) -> dict:
        elapsed_ms = (time.perf_counter() - self._start) * 1000 / self._iters
        seconds = elapsed_ms / 1000 * self._iters
        data = result.data
        if data is not None:  # the interval's counts: since the last record, or since this process began
            data, self._data_before = data - (self._data_before or type(data)()), data
        rates, tokens, row_tokens = throughput(
            Interval(seconds, self._iters, self._loss_tokens, data), world_size=self.world_size,
            global_batch_size=self.global_batch_size, seq_length=self.tokens_per_iteration // self.global_batch_size,
            flops_per_row=self.flops_per_iteration / 3 / self.global_batch_size if self.flops_per_iteration else None,
            peak=self.peak)
        self.trained_tokens += tokens
        self.trained_row_tokens += row_tokens
        self.trained_seconds += seconds
        record = {
            "split": "train",
            "iteration": iteration,
            "lm_loss": self._loss_sum / self._tokens if self._tokens else float("nan"),
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "loss_scale": result.loss_scale,
            "consumed_samples": consumed_samples,
            **({"consumed_rows": consumed_rows} if data is not None else {}),
            "batch_size": self.global_batch_size,
            "elapsed_ms": elapsed_ms,
            **rates,
            "skipped_iterations": self.skipped_total,
            "nan_iterations": self.nan_total,
            "skipped_samples": result.skipped_samples,
            **self.data_report.fields(result.data, data, iteration),
            "peak_memory_gib": _peak_memory_gib(self.device),
            **_peaks_per_rank(self.device),
            **_alloc_retries(self.device),
            **{f"grad_norm_{name}": norm for name, norm in result.module_grad_norms.items()},
        }
        # the host's waits for micro-batches (this rank's): an upper bound on the GPU's idle time for data
        record["data_wait_ms"] = self._data_wait * 1000 / self._iters
        record["data_wait_share"] = record["data_wait_ms"] / elapsed_ms if elapsed_ms else 0.0
        gc_seconds, gc_passes = self.gc_pauses.take()
        record["gc_ms"], record["gc_passes"] = gc_seconds * 1000 / self._iters, gc_passes  # per iteration, interval
        if timers:
            record["timers_ms"] = timers
        return record

    def _emit(self, record: dict, timers) -> None:
        line = format_line(record, self.total_iters, "GPU" if self.device.type == "cuda" else "rank")
        (self.progress.console.print if self.progress else print)(line)
        warning = self.data_report.warning(record)
        record.pop("interval_first_iteration", None)
        if warning:
            (self.progress.console.print if self.progress else print)(warning)
        if timers:
            (self.progress.console.print if self.progress else print)(format_timers(timers))
        sys.stdout.flush()
        if self.metrics_file:
            with self.metrics_file.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.tensorboard:
            samples = record["consumed_samples"]
            for key, name in _SCALARS:
                if key in record:
                    self.tensorboard.add_scalar(name, record[key], record["iteration"])
                    self.tensorboard.add_scalar(f"{name} vs samples", record[key], samples)
            if record.get("answer_tokens"):
                self.tensorboard.add_scalar("data/truncated-answer-share",
                                            record["truncated_answer_tokens"] / record["answer_tokens"],
                                            record["iteration"])
            if "skipped_samples" in record and "samples" in record:
                self.tensorboard.add_scalar("data/skipped-samples", record["skipped_samples"], record["iteration"])
            self.tensorboard.flush()

    def _per_iteration_scalars(self, iteration: int, result, samples: int) -> None:
        values = {"lm loss": result.lm_loss, "learning-rate": result.lr, "grad-norm": result.grad_norm,
                  "batch-size": self.global_batch_size, "loss-scale": result.loss_scale,
                  "num-zeros": result.num_zeros, "iteration-time": time.perf_counter() - self._start}
        values["iteration-time"] /= self._iters  # mean over the interval so far
        for name, value in values.items():
            if value is not None:
                self.tensorboard.add_scalar(name, value, iteration)
                self.tensorboard.add_scalar(f"{name} vs samples", value, samples)
        for name, value in result.moe_losses.items():
            self.tensorboard.add_scalar(name, value, iteration)
            self.tensorboard.add_scalar(f"{name} vs samples", value, samples)

    def close(self) -> None:
        self.gc_pauses.close()
        if self.progress:
            self.progress.stop()
        if self.tensorboard:
            self.tensorboard.close()


# (record key, TensorBoard name) of the interval's throughput figures, each also "vs samples"
_SCALARS = (("tokens_per_sec", "throughput/tokens-per-sec"),
            ("loss_tokens_per_sec_per_gpu", "throughput/loss-tokens-per-sec-per-gpu"),
            ("row_tokens_per_sec_per_gpu", "throughput/row-tokens-per-sec-per-gpu"),
            ("samples_per_sec", "throughput/samples-per-sec"), ("images_per_sec", "throughput/images-per-sec"),
            ("padding_share", "throughput/padding-share"), ("samples_per_row", "throughput/samples-per-row"),
            ("tflops_per_gpu", "throughput/tflops-per-gpu"), ("mfu", "throughput/mfu"))


def format_line(r: dict, total_iters: int, per: str = "GPU") -> str:
    """One log line; `per` names what the per-device figures divide by: "GPU", or "rank" for CPU processes (whose
    TFLOP/s would only mislead, so they are left to the metrics file)."""
    def number(value, spec):
        return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

    parts = [
        f"iteration {r['iteration']:>6}/{total_iters}", f"consumed samples {r['consumed_samples']:>8}",
        f"elapsed ms/iter {r['elapsed_ms']:8.1f}", f"tokens/s/{per} {r['tokens_per_sec_per_gpu']:9.0f}",
    ]
    if "padding_share" in r:  # --data: the tokens above are the samples'; this share of the rows was padding
        parts.append(f"padding {r['padding_share']:.0%}")
    if "tflops_per_gpu" in r and per == "GPU":
        parts.append(f"TFLOP/s/GPU {r['tflops_per_gpu']:.3g}" + (f" (MFU {r['mfu']:.1%})" if "mfu" in r else ""))
    parts += [f"lr {r['lr']:.3E}", f"lm loss {number(r['lm_loss'], '.6E')}", f"grad norm {number(r['grad_norm'], '.3f')}",
              f"loss scale {r['loss_scale']:g}", f"skipped iters {r['skipped_iterations']}",
              f"nan iters {r['nan_iterations']}"]  # iterations; the data's skipped samples are data_parts'
    if r.get("data_wait_share", 0) >= 0.01:  # the training thread waited for its micro-batches
        parts.append(f"data wait {r['data_wait_share']:.0%}")
    if r.get("gc_ms", 0) >= 1:  # the host stalled in Python's garbage collector (see --gc-interval)
        parts.append(f"gc {r['gc_ms']:.0f} ms/iter")
    if r["peak_memory_gib"] is not None:
        parts.append(f"peak mem {r['peak_memory_gib']:.2f} GiB")
    parts += data_parts(r)
    return " | ".join(parts)


def _peak_memory_gib(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # CPU: the process's peak RSS (KiB)


def _alloc_retries(device: torch.device) -> dict:
    """The caching allocator's retries so far on this rank: each one freed the cache and synchronized after a
    failed cudaMalloc, a run at the edge of memory crawls while the count climbs."""
    if device.type != "cuda":
        return {}
    return {"alloc_retries": int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))}


def _peaks_per_rank(device: torch.device) -> dict:
    """Every rank's peak allocated and reserved GiB (a gather over the world), to compare with `mimo plan`'s
    estimate per rank; nothing on the CPU. Collective: every rank records the same interval."""
    if device.type != "cuda":
        return {}
    import torch.distributed as dist

    mine = [torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        # host figures: no device tensor, so the host does not wait for the step's update
        return {"peak_memory_gib_ranks": [mine[0]], "peak_reserved_gib_ranks": [mine[1]]}
    mine = torch.tensor(mine, dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return {"peak_memory_gib_ranks": [t[0].item() for t in every],
            "peak_reserved_gib_ranks": [t[1].item() for t in every]}


def _tensorboard(directory):
    if not directory:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(directory))


def _progress(total_iters: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("eta"),
                        TimeRemainingColumn())
    progress.add_task("train", total=total_iters)
    progress.start()
    return progress
