"""megatron-core's optimizer (through MimoOptimizer: global grad norm and clipping across modules) and its
learning-rate scheduler, which counts in samples as Megatron's does."""

from __future__ import annotations

import torch

from .config import OptimizerOptions, SchedulerOptions


def build_optimizer(model, options: OptimizerOptions, params_dtype: torch.dtype):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=options.lr, min_lr=options.min_lr, weight_decay=options.weight_decay,
        adam_beta1=options.adam_beta1, adam_beta2=options.adam_beta2, adam_eps=options.adam_eps,
        clip_grad=options.clip_grad, bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype,
        use_distributed_optimizer=False,
    )
    # Given a MimoModel, megatron-core builds a MimoOptimizer: one optimizer per module grid.
    return get_megatron_optimizer(config, [model], use_gloo_process_groups=False)


def build_scheduler(optimizer, options: SchedulerOptions, optim: OptimizerOptions, global_batch_size: int,
                    train_samples: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    def samples(iters, count, default=0):
        return count if count else (iters * global_batch_size if iters else default)

    decay = samples(options.lr_decay_iters, options.lr_decay_samples, train_samples)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=samples(options.lr_warmup_iters, options.lr_warmup_samples),
        lr_decay_steps=max(decay, 1),
        lr_decay_style=options.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=max(train_samples, 1),
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False,
        wsd_decay_steps=samples(options.lr_wsd_decay_iters, options.lr_wsd_decay_samples) or None,
        lr_wsd_decay_style=options.lr_wsd_decay_style,
    )
