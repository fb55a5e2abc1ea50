"""One training iteration: megatron-core's forward/backward schedule over the micro-batches, per-module gradient
finalization with one per-token normalization for every grid, then the optimizer and scheduler step."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from .model import held_modules
from .topology import LANGUAGE, Topology


@dataclass
class StepResult:
    lm_loss: float  # per-token loss over the whole global batch
    num_tokens: int  # tokens that counted in the loss, whole global batch
    grad_norm: float | None
    skipped: bool
    lr: float  # the learning rate this iteration's update used
    module_grad_norms: dict[str, float]
    skipped_samples: int = 0  # unreadable samples the data dropped so far, all lanes


def to_device(value, device: torch.device, float_dtype: torch.dtype):
    """Move a (nested) batch to the device; floating-point model inputs take the model's dtype."""
    if isinstance(value, torch.Tensor):
        cast = float_dtype if value.is_floating_point() else value.dtype
        return value.to(device=device, dtype=cast, non_blocking=True)
    if isinstance(value, dict):
        return {k: to_device(v, device, float_dtype) for k, v in value.items()}
    return value


class Trainer:
    """Holds what a step needs and runs steps; the loop owns everything around it."""

    def __init__(self, model, optimizer, scheduler, hooks, settings, topology: Topology, device: torch.device,
                 params_dtype: torch.dtype, num_microbatches: int, global_batch_size: int, micro_batch_size: int,
                 seq_length: int, skipped_samples=lambda: 0):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.hooks, self.settings, self.topology = hooks, settings, topology
        self.device, self.params_dtype = device, params_dtype
        self.num_microbatches, self.global_batch_size = num_microbatches, global_batch_size
        self._token_source = is_token_source(topology)
        self._totals = torch.zeros(3, dtype=torch.float64, device=device)  # [loss sum, tokens, skipped samples]
        self._skipped_samples = skipped_samples
        config = model.config  # the language model's TransformerConfig; the schedule reads it
        config.finalize_model_grads_func = self._finalize_grads
        self._schedule = _schedule(topology, config)
        self._shape = {"seq_length": seq_length, "micro_batch_size": micro_batch_size}

    def forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        model_inputs = {k: v for k, v in batch.items() if k != "modality_inputs"}
        model_inputs = to_device(model_inputs, self.device, torch.float32)
        modality_inputs = to_device(batch.get("modality_inputs") or {}, self.device, self.params_dtype)
        output, loss_mask = model(**model_inputs, modality_inputs=modality_inputs or None)
        return output, partial(self._loss, loss_mask=loss_mask)

    def _loss(self, output_tensor, loss_mask):
        loss_sum, num_tokens = self.hooks.loss(settings=self.settings, output_tensor=output_tensor,
                                               loss_mask=loss_mask)
        self._totals[:2] += torch.stack([loss_sum.detach().double(), num_tokens.double()])
        return loss_sum, num_tokens, {}

    def _finalize_grads(self, model_chunks, num_tokens, pg_collection=None, force_all_reduce=False):
        """Reduce each module's gradients over its own grid, then divide all by the global token count."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        # Only one rank per LLM data lane contributes, so every rank of every grid learns the same totals.
        self._totals[2] = self._skipped_samples()
        totals = self._totals if self._token_source else torch.zeros_like(self._totals)
        dist.all_reduce(totals)
        self._global_totals = totals.tolist()
        scale = 1.0 / totals[1].item() if totals[1].item() > 0 else 0.0
        for name, module in held_modules(self.model):
            finalize_model_grads([module], num_tokens=None, pg_collection=self.topology.pg_collections[name],
                                 force_all_reduce=force_all_reduce)
            module.scale_gradients(scale)

    def step(self, data_iterator) -> StepResult:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._totals.zero_()
        self._schedule(
            forward_step_func=self.forward_step, data_iterator=data_iterator, model=[self.model],
            num_microbatches=self.num_microbatches, forward_only=False, **self._shape,
        )
        lr = self.optimizer.param_groups[0]["lr"]
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=self.global_batch_size)
        loss_sum, tokens, skipped_samples = self._global_totals
        return StepResult(lm_loss=loss_sum / max(tokens, 1), num_tokens=int(tokens), grad_norm=grad_norm,
                          skipped=not ok, lr=lr, module_grad_norms=dict(self.optimizer.module_grad_norms),
                          skipped_samples=int(skipped_samples))


def _schedule(topology: Topology, config):
    """megatron-core's schedule for the layout: no pipelining when colocated; the multimodule 1F1B schedule with
    the bridge communicator when the encoders and the LLM have ranks of their own."""
    from megatron.core.pipeline_parallel import schedules

    if topology.colocated:
        return partial(schedules.forward_backward_no_pipelining, pg_collection=topology.pg_collections[LANGUAGE])
    from megatron.core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator
    from megatron.core.process_groups_config import MultiModuleProcessGroupCollection

    encoders = [name for name in topology.parallelism if name != LANGUAGE]
    communicator = MultiModulePipelineCommunicator(
        topology.grids, {**{name: [LANGUAGE] for name in encoders}, LANGUAGE: []}, config,
        dim_mapping={"s": 0, "b": 1, "h": 2},  # MimoModel's LLM activations are [s, b, h]
        module_output_ndim={name: 2 for name in encoders},  # encoder outputs are [tokens, h]
    )
    pgs = MultiModuleProcessGroupCollection(
        module_pgs=dict(topology.pg_collections),
        language_model_module_name=LANGUAGE if topology.holds(LANGUAGE) else None,
    )
    return partial(schedules.forward_backward_pipelining_without_interleaving, p2p_communicator=communicator,
                   pg_collection=pgs)


def is_token_source(topology: Topology) -> bool:
    """One rank per LLM data lane: the last pipeline stage's first TP (and CP) rank."""
    pgc = topology.pg_collections.get(LANGUAGE)
    if pgc is None:
        return False
    return pgc.pp.rank() == pgc.pp.size() - 1 and pgc.tp.rank() == 0 and pgc.cp.rank() == 0
