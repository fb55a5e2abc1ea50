"""The run, top to bottom: config -> launch -> topology -> model/optimizer -> loop."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from mimo.errors import UsageError
from mimo.plugins import BuildContext, DataContext, Registry
from mimo.plugins.settings import build_settings

from . import launch, topology
from .config import DEFAULT_TRAIN_ITERS, RunConfig
from .metrics import MetricsLogger
from .model import build_model, count_parameters
from .optim import build_optimizer, build_scheduler
from .step import Trainer, _is_token_source


def run(config: RunConfig, registry: Registry | None = None) -> list[dict]:
    """Train as configured; return the logged records (on the logging rank; empty elsewhere)."""
    config.validate()
    registry = registry or Registry()
    provider, _ = registry.get(config.provider)
    hooks = registry.hooks(config.provider)
    settings = build_settings(provider, config.provider_settings, config.provider_config)
    shapes = hooks.model_shape(settings=settings)
    t = config.training

    # Everything that can be checked is checked before any process group exists.
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
    parallelism = topology.plan(config.layout, world_size, shapes)
    lanes = parallelism[topology.LANGUAGE].dp
    global_batch = t.global_batch_size or t.micro_batch_size * lanes
    if global_batch % (t.micro_batch_size * lanes):
        raise UsageError(f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size x LLM "
                         f"data-parallel size = {t.micro_batch_size} x {lanes}")
    num_microbatches = global_batch // (t.micro_batch_size * lanes)
    train_iters = t.train_iters or (t.train_samples // global_batch if t.train_samples else DEFAULT_TRAIN_ITERS)
    if train_iters < 1:
        raise UsageError(f"--train-samples {t.train_samples} is less than one global batch ({global_batch})")
    params_dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32

    device = launch.init_process(t.device)
    topo = topology.build(parallelism, backend="nccl" if device.type == "cuda" else "gloo")
    llm_pgs = topo.pg_collections.get(topology.LANGUAGE)
    seed_pgs = llm_pgs or next(iter(topo.pg_collections.values()))
    launch.seed_everything(t.seed, seed_pgs.tp.rank(), seed_pgs.ep.rank(), seed_pgs.expt_tp.rank())

    ctx = BuildContext(params_dtype=params_dtype, parallelism=parallelism, pg_collections=topo.pg_collections)
    model = build_model(hooks, settings, config.provider, topo, ctx, device)
    optimizer = build_optimizer(model, config.optimizer, params_dtype)
    scheduler = build_scheduler(optimizer, config.scheduler, config.optimizer, global_batch,
                                train_iters * global_batch)
    trainer = Trainer(model, optimizer, scheduler, hooks, settings, topo, device, params_dtype,
                      num_microbatches, global_batch)

    lane = llm_pgs.dp.rank() if llm_pgs else 0
    data = iter(hooks.data_provider(settings=settings, ctx=DataContext(
        micro_batch_size=t.micro_batch_size, num_microbatches=num_microbatches, lane=lane, num_lanes=lanes,
        seed=t.seed)))
    logging_rank = _is_token_source(topo) and lane == 0
    first = next(data)
    data = _chain(first, data)
    tokens_per_iteration = global_batch * first["input_ids"].shape[1]
    logger = MetricsLogger(config.logging.log_interval, train_iters, config.logging.metrics_file, logging_rank,
                           tokens_per_iteration)

    if logging_rank:
        print(describe_run(config.provider, parallelism, count_parameters(model), global_batch, num_microbatches,
                           t.micro_batch_size, lanes, device, t.precision, train_iters), flush=True)
    model.train()
    for iteration in range(1, train_iters + 1):
        result = trainer.step(data)
        logger.update(iteration, result, iteration * global_batch)
    dist.barrier()
    return logger.records if logging_rank else []


def describe_run(provider, parallelism, parameters, global_batch, num_microbatches, micro_batch, lanes, device,
                 precision, train_iters) -> str:
    """The run's opening line: what runs where, with how many parameters (this rank's shard), at which batch."""
    modules = " | ".join(
        f"{name}: ranks {p.first_rank}-{p.first_rank + p.num_ranks - 1} TP{p.tp} PP{p.pp} DP{p.dp}"
        + (f" EP{p.ep}" if p.ep > 1 else "") + (f", {parameters[name]:,} params" if name in parameters else "")
        for name, p in parallelism.items()
    )
    return (f"mimo run: provider {provider} | {modules} | global batch {global_batch} = {num_microbatches} "
            f"micro-batches x {micro_batch} x {lanes} lanes | {train_iters} iterations | {device.type} {precision}")


def _chain(first, rest):
    yield first
    yield from rest
