"""One rank's built run: the world joined, then the optimizer and schedule, the checkpoint restored, the data
opened, the training step, the logs, the profiler and the evaluations, ready for the loop (loop.py)."""

from __future__ import annotations

import dataclasses

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimo.errors import UsageError
from mimo.plugins import DataSource
from mimo.plugins.data_source import as_data_source
from mimo.wording import counted

from ..checkpoint import adapter_state
from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.foreign import load_foreign
from ..checkpoint.hf_load import hf_loader
from ..checkpoint.layout import run_info
from ..evaluation.evaluator import EvalSchedule, Evaluator, eval_context, eval_data_path
from ..parallel.model import count_parameters
from ..parallel.optim import build_optimizer, build_scheduler
from ..parallel.topology import Topology, is_data_source
from ..telemetry.metrics import MetricsLogger
from ..telemetry.memory_snapshot import MemorySnapshot
from ..telemetry.profiler import StepProfiler
from ..telemetry.skip_report import SkipReporter
from ..telemetry.timers import StepTimers
from ..telemetry.truncation import DataReport
from . import lora_report, signals
from .compilation import FirstIterations
from .cuda_graphs import LayerGraphs
from .plan import Plan
from .prefetch import read_ahead
from .step import TrainStep
from .world import World, join

SLOW_START_ENV = "MIMO_SLOW_START_S"  # a start-up longer than this many seconds (default 60) says where they went


@dataclass
class Session:
    """One rank's built run: what the loop steps, logs and saves. `iteration` and `consumed` count what is done."""

    plan: Plan
    world: World
    model: object
    optimizer: object
    scheduler: object
    step: TrainStep
    logger: MetricsLogger
    profiler: StepProfiler
    checkpointer: Checkpointer | None
    data: object  # what the step reads: the first batch, then `source`
    source: DataSource  # the data (read ahead, or the provider's own source); closed at the end
    skips: SkipReporter  # one line per skipped --data sample, on the rank that counts it
    iteration: int = 0
    consumed: int = 0
    evaluations: EvalSchedule | None = None  # --eval-iters: held-out loss during the run
    signal_watch: signals.SignalWatch | None = None  # --exit-signal and SIGINT: stop at an iteration boundary
    compiles: FirstIterations | None = None  # Triton pins and the compile report around the first iterations
    memory: MemorySnapshot | None = None  # --memory-snapshot-dir: the allocator's history to one iteration
    lora_summary: str | None = None  # --lora-rank: the summary's line on the adapters

    @property
    def device(self) -> torch.device:
        return self.world.device

    @property
    def topology(self) -> Topology:
        return self.world.topology


class _Phases:
    """The start-up's parts, each timed from where the one before ended."""

    def __init__(self):
        self.began = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name], self.last = now - self.last, now

    @property
    def total(self) -> float:
        return self.last - self.began

    def line(self) -> str:
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())
        return f"start-up {self.total:.1f} s: {parts}"


def start(plan: Plan) -> Session:
    """Join the world, build the groups, model, optimizer and schedule, restore a checkpoint, open the data."""
    config, t, c = plan.config, plan.config.training, plan.config.checkpoint
    phases = _Phases()
    world = join(plan)
    device, topo, params_dtype = world.device, world.topology, world.params_dtype
    phases.done("joining")
    memory = MemorySnapshot(config.logging.memory_snapshot_dir, config.logging.memory_snapshot_iteration,
                            rank=dist.get_rank())
    model = world.build_model()
    adapters = lora_report.adapter_counts(model) if config.adapters.enabled else None  # collective
    phases.done("the model")
    optimizer = build_optimizer(config.optimizer, model=model, params_dtype=params_dtype)
    phases.done("the optimizer")
    scheduler = build_scheduler(config.scheduler, optimizer=optimizer, optimizer_options=config.optimizer,
                                global_batch_size=plan.global_batch_size,
                                train_samples=plan.train_iters * plan.global_batch_size)

    checkpointer, start_iteration, consumed, data_state, source = None, 0, 0, None, None
    if c.save or c.load or c.pretrained or c.pretrained_llm or c.pretrained_vision:
        info = run_info(plan, plan.settings, lane_data_state=False)  # known once the data is open, below
        if adapters is not None:
            info["adapters"] = lora_report.record(plan, adapters)  # for mimo ckpt inspect
        checkpointer = Checkpointer(
            c, model=model, topology=topo, run_info=info, optimizer=optimizer, scheduler=scheduler,
            # also called by load(), as the template of what it reads, before the data is open (source None)
            data_state=lambda: {"loader": source.state_dict() if source is not None else None},
            load_foreign=lambda path, directory: load_foreign(plan.hooks, plan.settings, model, path, directory),
            load_hf=hf_loader(plan, model))
        start_iteration, consumed, data_state = checkpointer.load()
        phases.done("loading")
    base = None
    if adapters is not None:  # the base as loaded (a resume's: the record it loaded), kept by the checkpoints
        base = adapter_state.base_record(c, t.seed, checkpointer.adapter_base if checkpointer else None)
        if checkpointer:
            checkpointer.adapter_base = base
    # Index-addressed data continues from the samples already seen; a loader with its own state restores it.
    ahead = config.data.prefetch_microbatches
    if ahead and plan.step_encoders:  # the step takes all its micro-batches at once: make the next step's meanwhile
        ahead = max(ahead, plan.num_microbatches)
    # --data: the lane loader's own thread reads ahead (as of what was consumed, for its state), pinned on GPUs
    data_ctx = dataclasses.replace(world.data_context(consumed), read_ahead=ahead, pin_memory=device.type == "cuda")
    source = as_data_source(plan.hooks.data_provider(settings=plan.settings, ctx=data_ctx), config.provider)
    source.hold_data_errors = True  # a data error mid-run: the loop stops at the boundary, saving first
    if checkpointer:
        checkpointer.run_info["lane_data_state"] = source.resumable  # then tied to its lane
    if data_state and data_state.get("loader") is not None:
        if not source.resumable:
            raise UsageError(f"the checkpoint in {c.load} holds a data loader's position (it was saved with "
                             f"--data): resume with the same --data, or pass --finetune")
        source.load_state_dict(data_state["loader"])
    counted_before = source.data_counts()  # a resume's counts: this process's throughput counts from here
    first_batch = next(source)
    if data_ctx.data_path and not data_ctx.opened_loaders:  # never train on synthetic data in place of --data
        raise UsageError(f"--data {data_ctx.data_path}: provider '{config.provider}' does not read datasets (its "
                         f"data_provider opened no ctx.energon_loader): drop --data, or use a provider that reads it")
    seq_length = first_batch["input_ids"].numel() // data_ctx.rows  # packed rows arrive laid end to end
    timers = StepTimers(config.logging.log_timers, modules=list(plan.parallelism), held=list(topo.pg_collections),
                        device=device)
    graphs = (LayerGraphs(model=model, optimizer=optimizer, topology=topo, seq_length=seq_length,
                          micro_batch_size=t.micro_batch_size, num_microbatches=plan.num_microbatches)
              if config.performance.cuda_graphs else None)
    step = TrainStep(t, world=world, model=model, optimizer=optimizer, scheduler=scheduler, seq_length=seq_length,
                     data_counts=source.data_counts, data_start=counted_before, timers=timers,
                     layer_graphs=graphs, step_encoders=plan.step_encoders)

    logging_rank = world.logging_rank  # lane 0 logs
    flops = plan.hooks.model_flops(settings=plan.settings)
    logger = MetricsLogger(config.logging, total_iters=plan.train_iters, enabled=logging_rank,
                           global_batch_size=plan.global_batch_size,
                           tokens_per_iteration=plan.global_batch_size * seq_length,
                           flops_per_iteration=(3 * sum(flops.values()) * plan.global_batch_size  # fwd + 2x bwd
                                                if flops else None),
                           world_size=plan.world_size, device=device, timers=timers,
                           data_report=DataReport(share=config.data.truncation_warning, seq_length=seq_length,
                                                  longest_needed=lambda: source.longest_needed),
                           data_start=step.data_start)
    if logging_rank:
        print(describe_run(plan, count_parameters(model), device, t.precision, adapters), flush=True)
        if adapters is not None:
            print(lora_report.details(plan, adapters, base), flush=True)
        if start_iteration:
            seen = step.data_start.samples if step.data_start is not None else consumed  # samples, not packed rows
            print(f"resumed from {c.load} at iteration {start_iteration} ({seen} samples consumed)", flush=True)
        note = source.size_note()
        if note:  # a dataset smaller than a micro-batch: say that samples repeat
            print(note, flush=True)
        if phases.total > float(os.environ.get(SLOW_START_ENV, "60")):  # the whole model: drawing its weights
            print(phases.line(), flush=True)
    profiler = StepProfiler(config.logging, rank=dist.get_rank(), device=device, report=logging_rank)
    model.train()
    reader = read_ahead(source, ahead, device)  # a provider's own data (a resumable source reads ahead itself)
    skips = SkipReporter(source, enabled=is_data_source(topo),  # the rank whose count enters the total
                         rank=dist.get_rank() if plan.world_size > 1 else None)
    evaluations = None
    if config.evaluation.eval_iters:
        evaluator = Evaluator(config.evaluation, world=world, model=model,
                              data_ctx=eval_context(data_ctx, "val", eval_data_path(config)))
        evaluations = EvalSchedule(config.evaluation, evaluator=evaluator, train_iters=plan.train_iters,
                                   logger=logger)
    compiles = FirstIterations(config.compile, hooks=plan.hooks, settings=plan.settings, device=device,
                               speaks=logging_rank)
    return Session(plan, world, model, optimizer, scheduler, step, logger, profiler, checkpointer,
                   _chain(first_batch, reader), reader, skips, start_iteration, consumed, evaluations,
                   compiles=compiles, memory=memory,
                   lora_summary=lora_report.summary(plan, adapters, base) if adapters is not None else None)


def describe_run(plan: Plan, held: dict[str, int], device: torch.device, precision: str,
                 adapters: dict[str, int] | None = None) -> str:
    """The run's opening line: what runs where, with how many parameters (each module's whole count as the
    provider's model_shape gives it, whatever the layout; else this rank's shard of the modules it holds), at
    which batch; with `adapters` (LoRA: their parameters per module), that only they train."""
    def count(name: str) -> str:
        total = plan.shapes[name].num_parameters
        if total is not None:
            return f", {total:,} params"
        return f", {held[name]:,} params on this rank" if name in held else ""

    modules = " | ".join(plan.layout.describe_module(name) + count(name) for name in plan.parallelism)
    return (f"mimo run: provider {plan.config.provider} | {modules} | global batch {plan.global_batch_size} = "
            f"{counted(plan.num_microbatches, 'micro-batch')} x {plan.config.training.micro_batch_size} x "
            f"{counted(plan.num_lanes, 'lane')}{_encoder_pass(plan)} | {counted(plan.train_iters, 'iteration')} | "
            f"{device.type} {precision}" + (lora_report.header(plan, adapters) if adapters is not None else ""))


def _encoder_pass(plan) -> str:
    if not plan.step_encoders:
        return ""
    return " (encoders once per step" + (", recomputed in backward to fit: --encoder-pass micro-batch keeps "
                                         "their activations)" if plan.encoders_recomputed else ")")


def _chain(first, rest):
    yield first
    yield from rest
