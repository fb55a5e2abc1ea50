"""One micro-batch's forward and the provider's loss, as megatron-core's schedules call it (`forward_step_func`):
training runs it forward and backward, evaluation forward only."""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch.profiler import record_function

from ..parallel.context_parallel import check_row, local_rows
from ..parallel.embedding_merge import placeholder_rows
from ..telemetry.timers import StepTimers
from .batch_transfer import to_device
from .encoder_pass import EncodedBatch
from .shared_rank_batches import SharedRankBatches


class ForwardLoss:
    """megatron-core's `forward_step_func` for MimoModel: one micro-batch to the device, the forward, and the
    provider's loss hook over the training loss mask. Each micro-batch's loss sum and token count are added to
    `totals` ([loss sum, tokens], float64), which the caller reduces over the lanes and divides once.

    `timers` (training's StepTimers) time and label the data and forward phases; evaluation passes none."""

    def __init__(self, hooks, settings, device: torch.device, params_dtype: torch.dtype, totals: torch.Tensor,
                 timers: StepTimers | None = None):
        self.hooks, self.settings, self.device, self.params_dtype = hooks, settings, device, params_dtype
        self.totals, self.timers = totals, timers
        self._shared = None  # SharedRankBatches of the model, False where its modules share one DP layout

    def _phase(self, name: str):
        return self.timers.phase(name) if self.timers is not None else contextlib.nullcontext()

    def _label(self, name: str):
        return record_function(name) if self.timers is not None else contextlib.nullcontext()

    def __call__(self, data_iterator, model):
        with self._phase("data"):
            batch = next(data_iterator)
        embeddings = None
        if isinstance(batch, EncodedBatch):  # --encoder-pass step: the encoders ran for the whole step
            batch, embeddings = batch.batch, batch.embeddings
        if self._shared is None:
            self._shared = SharedRankBatches.for_model(model) or False
        exchange_rows = None
        if self._shared:  # colocated encoders at a TP of their own: the LLM's rows of what this rank read
            batch = self._shared(batch)
            exchange_rows = batch.pop("exchange_rows")
        check_row(model, batch["input_ids"].shape[-1])
        with self._label("mimo/to-device"):
            model_inputs = {k: v for k, v in batch.items() if k != "modality_inputs"}
            if "packing_kwargs" in model_inputs:
                model_inputs["packing_kwargs"] = local_rows(model, model_inputs["packing_kwargs"])
            # where each encoder's placeholders are, found on the host: the merge then never waits for the GPU
            rows = placeholder_rows(batch["input_ids"], model.special_token_ids, self.device)
            model_inputs = to_device(model_inputs, self.device, torch.float32)
            modality_inputs = {}
            if embeddings is None:
                modality_inputs = to_device(batch.get("modality_inputs") or {}, self.device, self.params_dtype)
        with self._phase("forward"):
            output, loss_mask = model(**model_inputs, modality_inputs=modality_inputs or None,
                                      placeholder_rows=rows, modality_embeddings=embeddings,
                                      exchange_rows=exchange_rows)
        return output, partial(self.loss, loss_mask=loss_mask)

    def loss(self, output_tensor, loss_mask):
        # the provider's loss hook; summed here, divided once by all lanes' tokens
        loss_sum, num_tokens = self.hooks.loss(settings=self.settings, output_tensor=output_tensor,
                                               loss_mask=loss_mask)
        self.totals += torch.stack([loss_sum.detach().double(), num_tokens.double()])
        return loss_sum, num_tokens, {}
