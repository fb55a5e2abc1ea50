"""`mimo eval`: the held-out loss of a checkpoint, without training, in any layout that fits.

The world, grids and model are built as for a run (world.py); the checkpoint's weights load through the
resharding path (`--pretrained`, weights only, strict); then one evaluation (core/evaluation/evaluator.py) reads `--eval-iters` global
batches of the chosen split. The same samples as a training run's evaluations: the same eval seed, lanes and
loader workers give the same batches.
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import torch.distributed as dist

from mimo.errors import UsageError

from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.hf_load import hf_loader
from ..checkpoint.layout import read_tracker, run_info
from ..checkpoint.resume import NO_SAVING, require_checkpoint
from ..config import RunConfig
from ..evaluation.evaluator import EvalResult, Evaluator, eval_context, eval_data_path, report
from .world import join

DEFAULT_EVAL_ITERS = 10


def eval_config(config: RunConfig, split: str) -> RunConfig:
    """The run options `mimo eval` means: the checkpoint's weights only, `--eval-iters` (default 10) batches."""
    c, e = config.checkpoint, config.evaluation
    if c.load and c.pretrained and not config.adapters.enabled:  # a LoRA checkpoint: --pretrained is its base
        raise UsageError("mimo eval: give one of --load CKPT and --pretrained PATH")
    if not (c.load or c.pretrained or c.pretrained_llm or c.pretrained_vision):
        raise UsageError("mimo eval needs --load CKPT (a mimo checkpoint) or --pretrained PATH (a mimo checkpoint "
                         "or a Hugging Face folder; or its parts --pretrained-llm, --pretrained-vision)")
    if split not in ("val", "test"):
        raise UsageError(f"--split {split}: use val or test")
    if split != "val" and not (e.eval_data or config.data.data):
        raise UsageError(f"--split {split} needs --data (the provider's synthetic data has one eval split, val)")
    if c.load:
        require_checkpoint(c.load)
    # the checkpoint's weights as --pretrained; a LoRA checkpoint's adapters load over their base (--pretrained)
    weights = (dataclasses.replace(c, **NO_SAVING, load_optim=False, load_rng=False, load_scheduler=False)
               if config.adapters.enabled and c.load else
               dataclasses.replace(c, load=None, pretrained=c.load or c.pretrained, **NO_SAVING))
    return dataclasses.replace(
        config,
        checkpoint=weights,
        evaluation=dataclasses.replace(e, eval_iters=e.eval_iters or DEFAULT_EVAL_ITERS),
        training=dataclasses.replace(config.training, train_iters=1, train_samples=None),
    )


def evaluate_checkpoint(plan, split: str, json_path: Path | None = None) -> EvalResult:
    """Run in every process of the world: build, load, evaluate once, report on the logging rank."""
    config = plan.config
    try:
        world = join(plan)
        model = world.build_model()
        checkpoint = config.checkpoint.load or config.checkpoint.pretrained
        Checkpointer(config.checkpoint, model=model, topology=world.topology,
                     run_info=run_info(plan, plan.settings, False), load_hf=hf_loader(plan, model)).load()
        path = eval_data_path(config)
        data_ctx = eval_context(world.data_context(0), split, path)
        evaluator = Evaluator(config.evaluation, world=world, model=model, data_ctx=data_ctx)
        result = evaluator.evaluate(read_tracker(checkpoint) or 0)
        logging_rank = world.logging_rank
        metrics_file = Path(config.logging.metrics_file) if config.logging.metrics_file and logging_rank else None
        report(result, types.SimpleNamespace(enabled=logging_rank, metrics_file=metrics_file, tensorboard=None,
                                             progress=None), None, 0)
        if json_path and logging_rank:
            figures = {**result.record(), "checkpoint": str(checkpoint), "data": path,
                       "global_batch_size": plan.global_batch_size, "eval_iters": config.evaluation.eval_iters}
            Path(json_path).write_text(json.dumps(figures, indent=2) + "\n")
        dist.barrier()
        return result
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
