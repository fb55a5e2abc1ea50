"""Held-out evaluation: the loss on samples training never reads, forward only, through the training schedules.

An evaluation reads `--eval-iters` global batches of the eval split (energon's `val` split of `--data` or of
`--eval-data`; without `--data`, the provider's synthetic data from `EVAL_SEED`) through megatron-core's schedule
for the layout (colocated, heterogeneous grids, PP, EP) with `forward_only=True`, sums the provider's loss hook
over the training loss mask, and divides by the tokens that counted: a per-token loss over every lane, however
the samples were packed.

It leaves training as it was: its data iterator is its own, opened afresh for every evaluation (so each one reads
the same samples and the figures compare), the RNG states are put back afterwards, no gradient or MoE statistic
is recorded (no_grad; the MoE loss tracker is cleared), and its time is taken out of the training throughput.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimo.data.counts import DataCounts
from mimo.errors import UsageError
from mimo.plugins import DataContext
from mimo.plugins.data_source import as_data_source

from ..forward import encoders_beside_stages
from ..forward.encoder_pass import StepEncoderPass
from ..forward.forward_loss import ForwardLoss
from ..forward.schedule import schedule_for
from ..parallel.model import parameters_gathered
from ..parallel.topology import counted_once, is_data_source, is_loss_source
from .predictions import Predictions, Predictor

# Synthetic eval data is drawn from this seed, whatever the training seed: evaluations of runs with different
# seeds read the same samples, and none of them trains on those (unless a run is seeded with it).
EVAL_SEED = 271_828_182


@dataclass
class EvalResult:
    iteration: int
    split: str
    lm_loss: float  # per-token loss over every sample read
    num_tokens: int  # tokens that counted in the loss
    samples: int  # sequences read (packed sequences when packing)
    seconds: float
    predictions: Predictions | None = None  # --eval-samples: answers generated and scored
    data: dict | None = None  # --data: skipped samples by reason, answer tokens cut by seq_length (of those read)

    @property
    def ppl(self) -> float:
        return math.exp(min(self.lm_loss, 20.0))  # Megatron's cap keeps a diverged run's figure finite

    def record(self) -> dict:
        record = {"split": self.split, "iteration": self.iteration, "lm_loss": self.lm_loss, "ppl": self.ppl,
                  "num_tokens": self.num_tokens, "samples": self.samples, "eval_seconds": self.seconds,
                  **(self.data or {})}
        if self.predictions is not None:
            p = self.predictions
            record.update(exact_match=p.exact_match, token_f1=p.token_f1, predictions=p.records)
        return record


def eval_context(base: DataContext, split: str, data_path: str | None) -> DataContext:
    """The eval split's DataContext: the same positions and lanes as `base` (so every layout reads the same global
    batches), from the first sample, with the eval seed; `data_path` None means the provider's synthetic data."""
    return dataclasses.replace(base, seed=EVAL_SEED, start_sample=0, split=split, data_path=data_path,
                               opened_loaders=[])


def eval_data_path(config) -> str | None:
    """The dataset evaluations read: --eval-data, else --data (its val split); None for synthetic data."""
    path = config.evaluation.eval_data or config.data.data
    return str(path) if path else None


class Evaluator:
    """Runs evaluations on every rank (each is collective over the world); the logging rank reports them."""

    def __init__(self, options, *, world, model, data_ctx: DataContext):
        """`options`: the run's EvalOptions (--eval-iters); `world`: this rank's joined world (the commands' World:
        its plan, topology, device and params_dtype are read); `data_ctx`: the eval
        split's DataContext (`eval_context`)."""
        plan = world.plan
        hooks, settings, topology, device = plan.hooks, plan.settings, world.topology, world.device
        params_dtype = world.params_dtype
        self.model, self.hooks, self.settings, self.topology = model, hooks, settings, topology
        self.device, self.params_dtype, self.data_ctx = device, params_dtype, data_ctx
        self.eval_iters, self.num_microbatches = options.eval_iters, plan.num_microbatches
        self.global_batch_size, self.provider_name = plan.global_batch_size, plan.config.provider
        self._data_source, self._loss_source = is_data_source(topology), is_loss_source(topology)
        # a schedule (and bridge communicator) of its own: the training step's is watched by the step timers
        self._schedule, _ = schedule_for(topology, model.config)
        # [loss sum, tokens, *DataCounts]: the loss and what the eval data skipped and cut, reduced at once
        self._totals = torch.zeros(2 + len(DataCounts.names()), dtype=torch.float64, device=device)
        # the training step's forward and loss hook, summing into the totals
        self._forward_step = ForwardLoss(hooks, settings, device, params_dtype, self._totals[:2])
        # the LLM's stages beside the encoders: the encoders run first, on the step's micro-batches
        self._beside = encoders_beside_stages.for_step(model, topology, StepEncoderPass(
            model, hooks=hooks, settings=settings, device=device, params_dtype=params_dtype)) \
            if getattr(model, "stages_beside_encoders", False) else None
        # A missing split fails now, not after training: opening the data reads the dataset's index, no sample.
        opened = self.hooks.data_provider(settings=settings, ctx=dataclasses.replace(data_ctx, opened_loaders=[]))
        as_data_source(opened, self.provider_name).close()
        self.predictor = (Predictor(options, world=world, model=model, data_path=data_ctx.data_path,
                                    split=data_ctx.split) if options.eval_samples else None)

    def evaluate(self, iteration: int) -> EvalResult:
        started = time.perf_counter()
        ctx = dataclasses.replace(self.data_ctx, opened_loaders=[])
        source = as_data_source(self.hooks.data_provider(settings=self.settings, ctx=ctx), self.provider_name)
        try:
            first = next(source)
            if ctx.data_path and not ctx.opened_loaders:
                raise UsageError(f"{ctx.data_path}: provider '{self.provider_name}' does not read datasets (its "
                                 f"data_provider opened no ctx.energon_loader), so it cannot evaluate on one")
            seq_length = first["input_ids"].numel() // ctx.rows  # packed rows arrive laid end to end
            data = _chain(first, source)
            self._totals.zero_()
            was_training = self.model.training
            with _rng_kept(self.device), torch.no_grad(), parameters_gathered(self.model):
                self.model.eval()  # no dropout, no RADIO position jitter
                try:
                    for _ in range(self.eval_iters):
                        batches = data
                        if self._beside is not None:
                            batches = iter(self._beside.forward([next(data) for _ in range(self.num_microbatches)]))
                        self._schedule(forward_step_func=self._forward_step, data_iterator=batches, model=[self.model],
                                       num_microbatches=self.num_microbatches, forward_only=True,
                                       seq_length=seq_length, micro_batch_size=ctx.micro_batch_size)
                    predictions = self.predictor.predict() if self.predictor else None
                finally:
                    self.model.train(was_training)
            counts = source.data_counts()
            if counts is not None:  # None: a source that counts nothing
                self._totals[2:] = torch.tensor(counts.vector(), dtype=torch.float64)
        finally:
            source.close()  # a loader's worker processes
        _clear_moe_tracker()
        # One rank per LLM lane (per CP part for the loss) counts: the all-reduce gives every rank all lanes' totals.
        totals = counted_once(self._totals, self._loss_source, self._data_source)
        dist.all_reduce(totals)
        loss_sum, tokens = totals[:2].tolist()
        counts = DataCounts.from_vector(totals[2:].tolist())
        data = None if not ctx.data_path else {
            "skipped_samples": counts.skipped, "skipped_unreadable": counts.unreadable,
            "skipped_unsupported": counts.unsupported, "skipped_too_long": counts.too_long,
            "skipped_over_image_budget": counts.over_image_budget,
            "truncated_answer_tokens": counts.cut_answer_tokens, "answer_tokens": counts.answer_tokens}
        return EvalResult(iteration, ctx.split, loss_sum / tokens if tokens else float("nan"), int(tokens),
                          self.eval_iters * self.global_batch_size, time.perf_counter() - started, predictions,
                          data)


class EvalSchedule:
    """When a training run evaluates (at the start if asked, every `interval` iterations, and at the end), and
    where the figures go: the console, the metrics file and TensorBoard, through the run's MetricsLogger."""

    def __init__(self, options, *, evaluator: Evaluator, train_iters: int, logger):
        self.evaluator, self.options, self.train_iters, self.logger = evaluator, options, train_iters, logger
        self.results: list[EvalResult] = []

    def at_start(self, iteration: int, consumed: int) -> None:
        if self.options.eval_at_start:
            self._evaluate(iteration, consumed)

    def after_iteration(self, iteration: int, consumed: int) -> None:
        interval = self.options.eval_interval
        if iteration == self.train_iters or (interval and iteration % interval == 0):
            self._evaluate(iteration, consumed)

    def _evaluate(self, iteration: int, consumed: int) -> None:
        result = self.evaluator.evaluate(iteration)
        self.results.append(result)
        report(result, self.logger, self.train_iters, consumed)
        self.logger.exclude(result.seconds)  # tokens/s, TFLOP/s and MFU count training alone


def format_eval_line(result: EvalResult, total_iters: int | None = None) -> str:
    at = f"iteration {result.iteration}" + (f"/{total_iters}" if total_iters else "")
    data = result.data or {}
    extra = f" | skipped samples {data['skipped_samples']}" if data.get("skipped_samples") else ""
    if data.get("truncated_answer_tokens"):
        extra += (f" | answer tokens cut by seq_length {data['truncated_answer_tokens']} of "
                  f"{data['answer_tokens']}")
    return (f"validation ({result.split}) at {at} | lm loss {result.lm_loss:.6E} | lm loss PPL {result.ppl:.6E} | "
            f"samples {result.samples} | tokens {result.num_tokens} | {result.seconds:.2f} s{extra}")


def report(result: EvalResult, logger, total_iters: int | None, consumed: int) -> None:
    """The eval line on the console; a `split` record in the metrics file; Megatron's TensorBoard names."""
    if not logger.enabled:
        return
    lines = [format_eval_line(result, total_iters)]
    if result.predictions is not None:
        lines += result.predictions.summary(result.split, result.iteration)
    for line in lines:
        if getattr(logger, "progress", None):
            logger.progress.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)
    if logger.metrics_file:
        with logger.metrics_file.open("a") as f:
            f.write(json.dumps({**result.record(), "consumed_samples": consumed}) + "\n")
    if logger.tensorboard:
        name = "validation" if result.split == "val" else result.split
        for tag, value in ((f"lm loss {name}", result.lm_loss), (f"lm loss {name} ppl", result.ppl)):
            logger.tensorboard.add_scalar(tag, value, result.iteration)
            logger.tensorboard.add_scalar(f"{tag} vs samples", value, consumed)
        if result.predictions is not None:
            p = result.predictions
            logger.tensorboard.add_scalar(f"exact match {name}", p.exact_match, result.iteration)
            logger.tensorboard.add_scalar(f"token f1 {name}", p.token_f1, result.iteration)
            logger.tensorboard.add_text(f"predictions {name}", p.markdown(), result.iteration)
        logger.tensorboard.flush()


@contextlib.contextmanager
def _rng_kept(device: torch.device):
    """Put torch's (and the GPU's) RNG and megatron-core's model-parallel RNG tracker back as they were."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    saved = tracker.get_states()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            tracker.set_states(saved)


def _clear_moe_tracker() -> None:
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def _chain(first, rest):
    yield first
    yield from rest
