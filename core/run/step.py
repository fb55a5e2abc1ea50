"""One training iteration: megatron-core's forward/backward schedule over the micro-batches, per-module gradient
finalization with one per-token normalization for every grid, then the optimizer and scheduler step.

The forward and loss of a micro-batch and the schedule for the layout are core/forward's, which evaluation shares.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.profiler import record_function

from mimo.data.counts import DataCounts
from mimo.plugins import LANGUAGE

from ..forward import encoders_beside_stages
from ..forward.encoder_pass import StepEncoderPass
from ..forward.forward_loss import ForwardLoss
from ..forward.schedule import schedule_for
from ..parallel.model import held_modules
from ..parallel.topology import counted_once, is_data_source, is_loss_source
from ..telemetry.timers import StepTimers

if TYPE_CHECKING:
    from ..config import TrainingOptions
    from .world import World


@dataclass
class StepResult:
    lm_loss: float  # per-token loss over the whole global batch
    num_tokens: int  # tokens that counted in the loss, whole global batch
    grad_norm: float | None
    skipped: bool  # no update was made (non-finite loss or gradients)
    lr: float  # the learning rate this iteration's update used
    module_grad_norms: dict[str, float]
    skipped_samples: int = 0  # samples the data skipped so far (every reason), all lanes
    loss_scale: float = 1.0
    num_zeros: int | None = None
    moe_losses: dict[str, float] = field(default_factory=dict)  # each auxiliary loss, mean over MoE layers
    data: DataCounts | None = None  # what --data's loaders consumed so far, all lanes (None: synthetic data)
    data_wait_s: float = 0.0  # this rank's host time waiting for its micro-batches (next()), this iteration


class TrainStep:
    """One training iteration, callable as `step(data_iterator)`: holds what an iteration needs; the loop owns
    everything around it (when to step, log, evaluate and save)."""

    def __init__(self, options: TrainingOptions, *, world: World, model, optimizer, scheduler, seq_length: int,
                 data_counts=lambda: None, data_start: DataCounts | None = None,
                 timers: StepTimers | None = None, layer_graphs=None, step_encoders: bool = False):
        """`world`: this rank's joined world (its plan, device, grids); `seq_length`: the tokens of a row;
        `data_counts()`: what the data consumed so far (a DataCounts, None for data that counts nothing);
        `data_start`: what it had consumed when this process began (a resume's), summed over the lanes into
        `self.data_start` here (collective: every rank builds its step);
        `layer_graphs`: --cuda-graphs' LayerGraphs; `step_encoders`: the encoders run once per step
        (--encoder-pass, core/forward/encoder_pass.py)."""
        plan = world.plan
        hooks, settings, topology, device = plan.hooks, plan.settings, world.topology, world.device
        params_dtype, micro_batch_size = world.params_dtype, options.micro_batch_size
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.hooks, self.settings, self.topology = hooks, settings, topology
        self.device, self.params_dtype = device, params_dtype
        self.num_microbatches, self.global_batch_size = plan.num_microbatches, plan.global_batch_size
        self._data_source, self._loss_source = is_data_source(topology), is_loss_source(topology)
        # [loss sum, tokens, *DataCounts, counted]: one all-reduce for the loss and the data's counts
        self._totals = torch.zeros(3 + len(DataCounts.names()), dtype=torch.float64, device=device)
        self._data_counts = data_counts
        config = model.config  # the language model's TransformerConfig; the schedule reads it
        config.finalize_model_grads_func = self._finalize_grads
        # The schedule holds back overlapped gradient reduction until the last micro-batch's backward.
        config.no_sync_func = model.no_sync
        self._schedule, communicator = schedule_for(topology, config)
        self.timers = timers or StepTimers(False, modules=[], held=[], device=device)
        if communicator is not None:
            self.timers.watch_bridge(communicator)
        self._shape = {"seq_length": seq_length, "micro_batch_size": micro_batch_size}
        self.layer_graphs = layer_graphs  # --cuda-graphs
        # the forward and loss of each micro-batch, summing into [loss sum, tokens] of the totals
        self.forward_step = ForwardLoss(hooks, settings, device, params_dtype, self._totals[:2], self.timers)
        # the optimizer reads the step's totals at its one wait for the GPU, and skips the update on every rank
        # after a non-finite loss or a data error (the iteration read empty micro-batches from some point on: no
        # update; the loop stops, saving the iteration before)
        optimizer.before_update = self._read_before_update
        self.encoder_pass = encoders_beside_stages.for_step(model, topology, StepEncoderPass(
            model, hooks=hooks, settings=settings, device=device, params_dtype=params_dtype) if step_encoders else None)
        self.data_start = self._lanes_sum(data_start)

    def _lanes_sum(self, counts: DataCounts | None) -> DataCounts | None:
        """`counts` (this rank's lanes') summed over the run's lanes, each counted once as the step's totals are;
        None for data that counts nothing. Collective."""
        vector = torch.zeros(len(DataCounts.names()) + 1, dtype=torch.float64, device=self.device)
        if counts is not None and self._data_source:
            vector[:-1] = torch.tensor(counts.vector(), dtype=torch.float64)
            vector[-1] = 1
        dist.all_reduce(vector)
        values = vector.tolist()
        return DataCounts.from_vector(values[:-1]) if values[-1] else None

    @record_function("mimo/finalize-grads")
    def _finalize_grads(self, model_chunks, num_tokens, pg_collection=None, force_all_reduce=False):
        """Reduce each module's gradients over its own grid, then divide all by the global token count."""
        # Only one rank per LLM data lane contributes, so every rank of every grid learns the same totals.
        counts = self._data_counts()
        if counts is not None:
            self._totals[2:-1] = torch.tensor(counts.vector(), dtype=torch.float64)
            self._totals[-1] = 1
        totals = counted_once(self._totals, self._loss_source, self._data_source)
        dist.all_reduce(totals)
        self._reduced_totals = totals  # read on the host where the optimizer has waited for the GPU anyway
        tokens = totals[1]
        # a device scalar: dividing by the token count here would make the host wait for the backward
        scale = torch.where(tokens > 0, 1.0 / tokens, torch.zeros_like(tokens)).float()
        modules = held_modules(self.model)
        if self.encoder_pass is not None:  # the encoders' backward, once, after the last micro-batch's
            # The LLM's gradients are complete already: its reduction and scaling go first, GPU work queued
            # ahead of the encoders' backward, whose small kernels the host launches slower than the GPU runs them
            # (and, over data-parallel ranks, a reduction that overlaps that backward).
            language = [(name, module) for name, module in modules if name == LANGUAGE]
            self._finalize_modules(language, scale, force_all_reduce)
            with self.timers.phase("backward"), record_function("mimo/encoders-backward"):
                self.encoder_pass.backward()
            modules = [(name, module) for name, module in modules if name != LANGUAGE]
        self._finalize_modules(modules, scale, force_all_reduce)

    def _finalize_modules(self, modules, scale: torch.Tensor, force_all_reduce: bool):
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        for name, module in modules:
            finalize_model_grads([module], num_tokens=None, pg_collection=self.topology.pg_collections[name],
                                 force_all_reduce=force_all_reduce)
            # one multi-tensor kernel: `grad_data *= scale` with a device scalar broadcasts it element by element,
            # at a third of the memory bandwidth (21 ms an iteration on the Nemotron slice)
            gradients = _gradient_tensors(module)
            if gradients:  # a frozen module has no buffer
                torch._foreach_mul_(gradients, scale)

    def _read_before_update(self) -> bool:
        """The step's device values on the host (the loss and data totals, the MoE losses), read at the one point
        where the optimizer has waited for the GPU (its gradient norms): True skips the update (a non-finite
        loss, or a data error on some lane). The same answer on every rank: the totals are world-reduced."""
        totals = self._reduced_totals.tolist()  # the same on every rank
        loss_sum, tokens = totals[:2]
        data = DataCounts.from_vector(totals[2:-1]) if totals[-1] else None
        lm_loss = loss_sum / max(tokens, 1)
        self._read = (lm_loss, tokens, data, _moe_losses())
        self._counted = math.isfinite(lm_loss) and not (data is not None and data.data_error)
        return not self._counted

    @record_function("mimo/step")
    def __call__(self, data_iterator) -> StepResult:
        if self.layer_graphs is not None:
            self.layer_graphs.before_step()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._totals.zero_()
        from megatron.core.pipeline_parallel import schedules

        data_iterator = waited = _Waited(data_iterator)
        if self.encoder_pass is not None:
            with self.timers.phase("data"):
                batches = [next(data_iterator) for _ in range(self.num_microbatches)]
            with self.timers.phase("forward"), record_function("mimo/encoders-forward"):
                data_iterator = iter(self.encoder_pass.forward(batches))
        with self.timers.backward_of(schedules):
            self._schedule(
                forward_step_func=self.forward_step, data_iterator=data_iterator, model=[self.model],
                num_microbatches=self.num_microbatches, forward_only=False, **self._shape,
            )
        with self.timers.phase("optimizer"):
            ok, _, num_zeros = self.optimizer.step()
        lm_loss, tokens, data, moe_losses = self._read
        # a rank whose modules are all frozen (an LLM rank in stage1) has no parameter groups: the schedule says
        groups = self.optimizer.param_groups
        lr = groups[0]["lr"] if groups else self.scheduler.get_lr({})
        if ok:
            self.scheduler.step(increment=self.global_batch_size)
        grad_norm = self.optimizer.grad_norm if self._counted else None  # none for a step whose loss did not count
        return StepResult(lm_loss=lm_loss, num_tokens=int(tokens), grad_norm=grad_norm, skipped=not ok, lr=lr,
                          module_grad_norms=dict(self.optimizer.module_grad_norms),
                          skipped_samples=data.skipped if data is not None else 0,
                          loss_scale=self.optimizer.loss_scale, num_zeros=num_zeros, moe_losses=moe_losses,
                          data=data, data_wait_s=waited.seconds)


def _moe_losses() -> dict[str, float]:
    """This rank's MoE auxiliary losses of the step (megatron-core's tracker), each averaged over the MoE layers
    that reported it; the tracker is cleared for the next step."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    losses = {}
    for name, entry in get_moe_layer_wise_logging_tracker().items():
        values = entry["values"].float()
        reported = values[values != 0]
        if reported.numel():
            losses[name.replace("_", "-")] = reported.mean().item()
    clear_aux_losses_tracker()
    return losses


def _gradient_tensors(module) -> list[torch.Tensor]:
    """The gradient buffers of a DDP-wrapped module: what megatron-core's `scale_gradients` scales."""
    buffers = module.buffers + module.expert_parallel_buffers
    return [t for b in buffers for t in (b.grad_data, *getattr(b, "extra_main_grads", ()))]


class _Waited:
    """The step's data iterator, timing the host's waits in next(): the most the GPU can have idled for data (the
    host runs ahead of the GPU; a wait longer than its lead leaves the GPU idle). No synchronize: always on."""

    def __init__(self, iterator):
        self._iterator, self.seconds = iterator, 0.0

    def __iter__(self):
        return self

    def __next__(self):
        started = time.perf_counter()
        try:
            return next(self._iterator)
        finally:
            self.seconds += time.perf_counter() - started
