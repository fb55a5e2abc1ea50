"""This process's part of the run, started the same way for every command that builds a model (`mimo run`,
`mimo eval`, `mimo ckpt import-hf`, the contract kit's worker): join the world, build the grids, seed,
describe the layout and the performance options to the provider's hooks, then build the model.

    world = join(plan)                  # the process group, grids, seeds and BuildContext of this rank
    model = world.build_model()         # the provider's MimoModel, seeded per module, wrapped for its grids
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimo.errors import UsageError
from mimo.plugins import LANGUAGE, BuildContext, DataContext
from mimo.wording import counted

from ..parallel import topology
from ..parallel.model import build_model, seed_tracker
from ..telemetry.sample_flops import SampleFlops
from . import compilation, launch
from .cuda_graphs import train_on_capture_stream
from .plan import Plan, gpu_only_options


@dataclass
class World:
    """One rank of a planned run, joined: its device, grids and groups, and what the build hooks are told."""

    plan: Plan
    device: torch.device
    topology: topology.Topology
    context: BuildContext
    seed: int

    @property
    def params_dtype(self) -> torch.dtype:
        return self.context.params_dtype

    def build_model(self, seed: int | None = None, trainable: bool = True):
        """The provider's MimoModel for the modules this rank holds (every rank calls it: collective); `trainable`
        False: every module frozen, no gradient buffers."""
        config = self.plan.config
        return build_model(config.performance, hooks=self.plan.hooks, settings=self.plan.settings,
                           provider=config.provider, topology=self.topology, context=self.context, device=self.device,
                           seed=self.seed if seed is None else seed,
                           distributed_optimizer=config.optimizer.use_distributed_optimizer, trainable=trainable,
                           adapters=config.adapters, adapter_targets=self.plan.adapter_targets,
                           grads_in_fp32=config.optimizer.optimizer_precision != "bf16")

    def data_context(self, start_sample: int = 0) -> DataContext:
        """What this rank's data iterator reads: its positions of every micro-batch, from `start_sample` on."""
        plan, t, data = self.plan, self.plan.config.training, self.plan.config.data
        first, count = topology.data_positions(plan.parallelism, dist.get_rank(), t.micro_batch_size)
        return DataContext(micro_batch_size=t.micro_batch_size, num_microbatches=plan.num_microbatches,
                           num_lanes=plan.num_lanes, seed=t.seed, first_position=first, num_positions=count,
                           start_sample=start_sample, data_path=str(data.data) if data.data else None,
                           num_workers=data.num_workers, pack_sequences=data.pack_sequences,
                           packing_buffer_size=data.packing_buffer_size, pack_image_tokens=plan.pack_image_tokens,
                           segment_multiple=plan.layout.shard_multiple,
                           sample_flops=SampleFlops(plan.hooks, plan.settings))

    @property
    def logging_rank(self) -> bool:
        """The one rank that reports for the run: the token source of the first LLM lane."""
        # (the lane from the LLM's DP rank: colocated encoders at a TP of their own read more than their lane)
        return topology.is_token_source(self.topology) and self.topology.pg_collections[LANGUAGE].dp.rank() == 0


def join(plan: Plan, *, seed: int | None = None) -> World:
    """Join the run's world (or make a world of one), build every module's grid and groups, seed torch and
    megatron-core's RNG tracker, and describe the layout and performance options for the build hooks.

    `seed` (default: the run's --seed) seeds the RNGs and the model's initial weights."""
    config, perf = plan.config, plan.config.performance
    launch.limit_device_connections(plan.layout)
    device = launch.init_process(config.training.device, config.launch.distributed_timeout_minutes)
    compilation.configure(config.compile, device)  # before the model: torch.compile off, the caches' places
    if dist.get_world_size() != plan.world_size:
        raise UsageError(f"the plan is for {counted(plan.world_size, 'rank')} but {dist.get_world_size()} joined")
    gpu_only = gpu_only_options(config)  # the plan refused them already where --device cpu was given
    if device.type != "cuda" and gpu_only:
        raise UsageError(f"{gpu_only[0]} needs a GPU; this run is on the CPU")
    if perf.cuda_graphs:
        train_on_capture_stream()
    topo = topology.build(plan.parallelism, backend="nccl" if device.type == "cuda" else "gloo")
    seed = config.training.seed if seed is None else seed
    torch.manual_seed(seed)
    # the LLM's ranks (or the first module's) seed the tracker; graph capture needs transformer-engine's tracker
    seed_tracker(topo, perf.cuda_graphs, (LANGUAGE, *topo.pg_collections), seed)
    return World(plan, device, topo, plan.build_context(topo.pg_collections, on_gpu=device.type == "cuda"), seed)
