"""The run, top to bottom: config -> (validated plan) -> launch -> topology -> model/optimizer -> loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimo.errors import UsageError
from mimo.plugins import BuildContext, DataContext, ModuleParallelism, Provider, Registry
from mimo.plugins.settings import build_settings

from ..evaluation import evaluator as evaluation
from . import launch, signals
from ..parallel import topology
from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.layout import run_info
from ..config import DEFAULT_TRAIN_ITERS, RunConfig
from .cuda_graphs import LayerGraphs, train_on_capture_stream
from ..telemetry.metrics import MetricsLogger
from ..parallel.model import build_model, count_parameters
from ..parallel.optim import build_optimizer, build_scheduler
from .prefetch import read_ahead
from ..checkpoint.foreign import load_foreign
from ..telemetry.profiler import StepProfiler
from ..telemetry.skip_report import SkipReporter, check_skip_fraction
from .step import Trainer, is_token_source
from ..telemetry.timers import StepTimers


@dataclass
class Plan:
    """Everything decided about a run before any process exists: validated, so workers only execute it."""

    config: RunConfig
    provider: Provider
    hooks: object
    settings: object
    shapes: dict
    parallelism: dict[str, ModuleParallelism]
    world_size: int
    global_batch_size: int
    num_microbatches: int
    train_iters: int

    @property
    def num_lanes(self) -> int:
        return self.parallelism[topology.LANGUAGE].dp


def prepare(config: RunConfig, registry: Registry | None = None, world_size: int | None = None) -> Plan:
    """Check the options, the provider and its settings, and the layout; raise UsageError on the first problem."""
    config.validate()
    registry = registry or Registry()
    provider, _ = registry.get(config.provider)
    hooks = registry.hooks(config.provider)
    settings = build_settings(provider, config.provider_settings, config.provider_config)
    shapes = hooks.model_shape(settings=settings)
    t = config.training
    if world_size is None:
        world_size = launch.world_size(config.launch)  # a launcher's world (torchrun, srun), or the options
    parallelism = topology.plan(config.layout, world_size, shapes, t.micro_batch_size,
                                config.performance.sequence_parallel)
    unknown = sorted(set(config.performance.recompute_modes()) - set(shapes) - {"*"})
    if unknown:
        raise UsageError(f"--recompute names module '{unknown[0]}', which provider '{config.provider}' does not "
                         f"have: use {', '.join(sorted(shapes))}")
    lanes = parallelism[topology.LANGUAGE].dp
    per_microbatch = t.micro_batch_size * lanes
    global_batch = t.global_batch_size or per_microbatch * (t.num_microbatches or 1)
    if global_batch % per_microbatch:
        raise UsageError(f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size x LLM "
                         f"data-parallel size = {t.micro_batch_size} x {lanes}")
    train_iters = t.train_iters or (t.train_samples // global_batch if t.train_samples else DEFAULT_TRAIN_ITERS)
    if train_iters < 1:
        raise UsageError(f"--train-samples {t.train_samples} is less than one global batch ({global_batch})")
    return Plan(config, provider, hooks, settings, shapes, parallelism, world_size, global_batch,
                global_batch // per_microbatch, train_iters)


@dataclass
class Session:
    """One rank's built run: what the loop steps, logs and saves. `iteration` and `consumed` count what is done."""

    plan: Plan
    model: object
    optimizer: object
    scheduler: object
    trainer: Trainer
    logger: MetricsLogger
    profiler: StepProfiler
    checkpointer: Checkpointer | None
    data: object  # what the trainer reads: the first batch, then `source`
    source: object  # the data iterator (read ahead, or the provider's own); closed at the end
    device: torch.device
    topology: topology.Topology
    skips: SkipReporter  # one line per skipped --data sample, on the rank that counts it
    iteration: int = 0
    consumed: int = 0
    evaluations: evaluation.EvalSchedule | None = None  # --eval-iters: held-out loss during the run
    signal_watch: signals.SignalWatch | None = None  # --exit-signal and SIGINT: stop at an iteration boundary


def build_context(plan: Plan, params_dtype: torch.dtype, topo: topology.Topology) -> BuildContext:
    perf = plan.config.performance
    return BuildContext(params_dtype=params_dtype, parallelism=plan.parallelism, pg_collections=topo.pg_collections,
                        recompute={name: perf.recompute_for(name) for name in plan.parallelism},
                        sequence_parallel=perf.sequence_parallel, fp8=perf.fp8, cuda_graphs=perf.cuda_graphs)


def start(plan: Plan) -> Session:
    """Join the world, build the groups, model, optimizer and schedule, restore a checkpoint, open the data."""
    config, t, c = plan.config, plan.config.training, plan.config.checkpoint
    params_dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
    device = launch.init_process(t.device, config.launch.distributed_timeout_minutes)
    if dist.get_world_size() != plan.world_size:
        raise UsageError(f"the plan is for {plan.world_size} ranks but {dist.get_world_size()} joined")
    perf = config.performance
    if device.type != "cuda" and (perf.fp8 != "none" or perf.cuda_graphs):
        raise UsageError(f"--{'fp8' if perf.fp8 != 'none' else 'cuda-graphs'} needs a GPU; this run is on the CPU")
    if perf.cuda_graphs:
        train_on_capture_stream()
    topo = topology.build(plan.parallelism, backend="nccl" if device.type == "cuda" else "gloo")
    seed_pgs = topo.pg_collections.get(topology.LANGUAGE) or next(iter(topo.pg_collections.values()))
    launch.seed_everything(t.seed, seed_pgs.tp.rank(), seed_pgs.ep.rank(), seed_pgs.expt_tp.rank(),
                           te_rng_tracker=perf.cuda_graphs)  # graph capture needs transformer-engine's tracker

    ctx = build_context(plan, params_dtype, topo)
    model = build_model(plan.hooks, plan.settings, config.provider, topo, ctx, device, t.seed,
                        config.optimizer.use_distributed_optimizer, config.performance)
    optimizer = build_optimizer(model, config.optimizer, params_dtype)
    scheduler = build_scheduler(optimizer, config.scheduler, config.optimizer, plan.global_batch_size,
                                plan.train_iters * plan.global_batch_size)

    checkpointer, start_iteration, consumed, data_state, source = None, 0, 0, None, None
    if c.save or c.load or c.pretrained:
        info = run_info(plan, plan.settings, lane_data_state=False)  # known once the data is open, below
        checkpointer = Checkpointer(c, model, optimizer, scheduler, topo, info,
                                    lambda: {"loader": source.state_dict() if hasattr(source, "state_dict") else None},
                                    load_foreign=lambda path, directory: load_foreign(plan.hooks, plan.settings,
                                                                                      model, path, directory))
        start_iteration, consumed, data_state = checkpointer.load()
    # Index-addressed data continues from the samples already seen; a loader with its own state restores it.
    data_ctx = data_context(plan, consumed)
    source = iter(plan.hooks.data_provider(settings=plan.settings, ctx=data_ctx))
    if checkpointer:
        checkpointer.run_info["lane_data_state"] = hasattr(source, "state_dict")  # then tied to its lane
    if data_state and data_state.get("loader") is not None:
        if not hasattr(source, "load_state_dict"):
            raise UsageError(f"the checkpoint in {c.load} holds a data loader's position (it was saved with "
                             f"--data): resume with the same --data, or pass --finetune")
        source.load_state_dict(data_state["loader"])
    first_batch = next(source)
    if data_ctx.data_path and not data_ctx.opened_loaders:  # never train on synthetic data in place of --data
        raise UsageError(f"--data {data_ctx.data_path}: provider '{config.provider}' does not read datasets (its "
                         f"data_provider opened no ctx.energon_loader): drop --data, or use a provider that reads it")
    seq_length = first_batch["input_ids"].numel() // data_ctx.rows  # packed rows arrive laid end to end
    timers = StepTimers(list(plan.parallelism), list(topo.pg_collections), device, config.logging.log_timers)
    graphs = (LayerGraphs(model, optimizer, topo, seq_length, t.micro_batch_size, plan.num_microbatches)
              if perf.cuda_graphs else None)
    trainer = Trainer(model, optimizer, scheduler, plan.hooks, plan.settings, topo, device, params_dtype,
                      plan.num_microbatches, plan.global_batch_size, t.micro_batch_size, seq_length,
                      skipped_samples=lambda: getattr(source, "skipped_samples", 0), timers=timers,
                      layer_graphs=graphs)

    logging_rank = is_token_source(topo) and data_ctx.first_position == 0  # lane 0 logs
    flops = plan.hooks.model_flops(settings=plan.settings)
    logger = MetricsLogger(config.logging, plan.train_iters, logging_rank, plan.global_batch_size,
                           plan.global_batch_size * seq_length,
                           3 * sum(flops.values()) * plan.global_batch_size if flops else None,  # fwd + 2x bwd
                           plan.world_size, device, timers)
    if logging_rank:
        print(describe_run(plan, count_parameters(model), device, t.precision), flush=True)
        if start_iteration:
            print(f"resumed from {c.load} at iteration {start_iteration} ({consumed} samples consumed)", flush=True)
    lg = config.logging
    profiler = StepProfiler(lg.profile_dir, lg.profile_step_start, lg.profile_step_end, dist.get_rank(), device,
                            report=logging_rank)
    model.train()
    reader = read_ahead(source, config.data.prefetch_microbatches, device)
    skips = SkipReporter(source, enabled=is_token_source(topo),  # the rank whose count enters the total
                         rank=dist.get_rank() if plan.world_size > 1 else None)
    evaluations = None
    if config.evaluation.eval_iters:
        evaluator = evaluation.Evaluator(
            model, plan.hooks, plan.settings, topo, device, params_dtype,
            evaluation.eval_context(data_ctx, "val", _eval_path(config)), config.evaluation.eval_iters,
            plan.num_microbatches, plan.global_batch_size, config.provider)
        evaluations = evaluation.EvalSchedule(evaluator, config.evaluation, plan.train_iters, logger)
    return Session(plan, model, optimizer, scheduler, trainer, logger, profiler, checkpointer,
                   _chain(first_batch, reader), reader, device, topo, skips, start_iteration, consumed, evaluations)


def _eval_path(config: RunConfig) -> str | None:
    path = config.evaluation.eval_data or config.data.data
    return str(path) if path else None


def data_context(plan: Plan, start_sample: int) -> DataContext:
    """What this rank's data iterator reads: its positions of every micro-batch, from `start_sample` on."""
    t, data = plan.config.training, plan.config.data
    first, count = topology.data_positions(plan.parallelism, dist.get_rank(), t.micro_batch_size)
    return DataContext(micro_batch_size=t.micro_batch_size, num_microbatches=plan.num_microbatches,
                       num_lanes=plan.num_lanes, seed=t.seed, first_position=first, num_positions=count,
                       start_sample=start_sample, data_path=str(data.data) if data.data else None,
                       num_workers=data.num_workers, pack_sequences=data.pack_sequences,
                       packing_buffer_size=data.packing_buffer_size)


def advance(session: Session, iterations: int) -> None:
    """Train `iterations` more iterations (at most to the end of the run): step, log, save."""
    plan, s = session.plan, session
    c, flop_check = plan.config.checkpoint, plan.config.logging.flop_check_iteration
    for iteration in range(s.iteration + 1, min(s.iteration + iterations, plan.train_iters) + 1):
        s.profiler.before(iteration)
        if iteration == flop_check:
            result = _counted_step(s.trainer, s.data, s.logger, s.device)
        else:
            result = s.trainer.step(s.data)
        s.profiler.after(iteration)
        s.iteration, s.consumed = iteration, s.consumed + plan.global_batch_size
        s.skips.report()
        s.logger.update(iteration, result, s.consumed)
        if s.evaluations:
            s.evaluations.after_iteration(iteration, s.consumed)
        if plan.config.data.data is not None:
            check_skip_fraction(result.skipped_samples, s.consumed, plan.config.data.max_skip_fraction,
                                plan.config.data.data)
        if s.checkpointer and c.save:
            s.checkpointer.wait(blocking=False)
            if iteration == plan.train_iters or (c.save_interval and iteration % c.save_interval == 0):
                s.checkpointer.save(iteration, s.consumed)
        if s.signal_watch is not None and (received := s.signal_watch.agreed(s.device)):
            signals.stop(s, received)


def finish(session: Session) -> list[dict]:
    """Close the logs, let background saves land, leave the world. Returns the logged records (logging rank)."""
    session.logger.close()
    session.skips.close()
    if session.checkpointer:
        session.checkpointer.wait(blocking=True)
    if hasattr(session.source, "close"):  # a read-ahead thread, or a loader's worker processes
        session.source.close()
    dist.barrier()
    # Tear the groups down while every rank is still here: gloo's threads abort a process that exits with them.
    dist.destroy_process_group()
    return session.logger.records if session.logger.enabled else []


def train(plan: Plan) -> list[dict]:
    """Run the plan in this process (one rank of the world). Returns the logged records on the logging rank."""
    with signals.SignalWatch(plan.config.launch.exit_signal) as watch:
        session = start(plan)
        session.signal_watch = watch
        try:
            if session.evaluations:
                session.evaluations.at_start(session.iteration, session.consumed)
            advance(session, plan.train_iters - session.iteration)
        except BaseException:
            session.logger.close()
            session.skips.close()
            raise
        return finish(session)


def _counted_step(trainer, data, logger, device):
    """One step under torch's FLOP counter (forward and backward, every rank's share summed), compared with the
    provider's model_flops figure the logs use for TFLOP/s and MFU."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as counter:
            result = trainer.step(data)
    except Exception as err:  # noqa: BLE001 - torch's counter rejects some operator uses (e.g. SDPA with GQA)
        raise UsageError(f"--flop-check-iteration: torch's FLOP counter failed on this model "
                         f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); run without "
                         f"--flop-check-iteration") from None
    counted = torch.tensor([float(counter.get_total_flops())], dtype=torch.float64, device=device)
    dist.all_reduce(counted)
    if logger.enabled:
        reported = logger.flops_per_iteration
        ratio = f"{reported / counted.item():.3f}" if reported and counted.item() else "n/a"
        print(f"FLOP check: torch's counter {counted.item():.4e} FLOPs this iteration, model_flops x 3 "
              f"{reported or 0:.4e} (ratio {ratio})", flush=True)
    return result


def run(config: RunConfig, registry: Registry | None = None) -> list[dict]:
    return train(prepare(config, registry))


def describe_run(plan: Plan, parameters: dict[str, int], device: torch.device, precision: str) -> str:
    """The run's opening line: what runs where, with how many parameters (this rank's shard), at which batch."""
    modules = " | ".join(
        f"{name}: ranks {p.first_rank}-{p.first_rank + p.num_ranks - 1} TP{p.tp} PP{p.pp} DP{p.dp}"
        + (f" EP{p.ep}" if p.ep > 1 else "") + (f", {parameters[name]:,} params" if name in parameters else "")
        for name, p in plan.parallelism.items()
    )
    return (f"mimo run: provider {plan.config.provider} | {modules} | global batch {plan.global_batch_size} = "
            f"{plan.num_microbatches} micro-batches x {plan.config.training.micro_batch_size} x {plan.num_lanes} "
            f"lanes | {plan.train_iters} iterations | {device.type} {precision}")


def _chain(first, rest):
    yield first
    yield from rest
