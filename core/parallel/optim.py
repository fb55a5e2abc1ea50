"""megatron-core's optimizer (through MimoOptimizer: global grad norm and clipping across modules) and its
learning-rate scheduler, which counts in samples as Megatron's does."""

from __future__ import annotations

import math

import torch
from torch.profiler import record_function

from mimo.errors import UsageError

from ..config import OptimizerOptions, SchedulerOptions


def _recording_optimizer_class():
    from megatron.core.models.mimo.optimizer import MimoOptimizer
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    class RecordingMimoOptimizer(MimoOptimizer):
        """MimoOptimizer that keeps each module's gradient norm (before clipping) for the logs, skips the update
        when the global norm is not finite (megatron-core only does that for fp16's loss scaler), and waits for
        the GPU once per step instead of four times.

        Same reduction as megatron-core's: every rank computes its modules' norms, a world MAX shares them; the
        found-inf flag rides on that collective. `before_update` (the training step's) runs right after that one
        wait, where reading device values costs nothing more, and may veto the update; every rank must answer
        alike. The update's success is not reduced over the world as megatron-core's step does: its optimizers
        report success unconditionally, and that reduction would make the host wait for the update itself, so
        that the GPU then idled while the host prepared the next step."""

        module_grad_norms: dict[str, float] = {}
        grad_norm: float = 0.0
        loss_scale: float = 1.0
        before_update = None  # () -> bool: True skips the update

        @torch.no_grad()
        def prepare_grads(self) -> bool:
            found_inf = self._module_norms(super().prepare_grads())
            with record_function("mimo/optimizer-read"):  # profiles tell the host's time after the wait apart
                self.loss_scale = float(self.get_loss_scale())  # the GPU is idle here: no wait
                vetoed = bool(self.before_update()) if self.before_update is not None else False
            return found_inf or not math.isfinite(self.grad_norm) or vetoed

        def get_grad_norm(self) -> float:
            return self.grad_norm  # computed once, in prepare_grads

        @torch.no_grad()
        def step(self):
            if self.prepare_grads():  # every rank decides alike: the flags and norms are world-reduced
                return False, None, None
            for opt in self._active_optimizers:  # clipping with the global norm, as megatron-core's step
                # megatron-core scales only below a coefficient of 1; asked anyway, it first walks every parameter
                # on the host while the GPU, which has just been waited for, has nothing queued
                if not 0.0 < opt.config.clip_grad < self.grad_norm + 1.0e-6:
                    continue
                params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=self.grad_norm,
                                                 use_decoupled_grad=opt.config.use_precision_aware_optimizer)
            num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
            with record_function("mimo/optimizer-update"):
                return self.step_with_ready_grads(), self.grad_norm, num_zeros

        @torch.no_grad()
        def _module_norms(self, found_inf: bool) -> bool:
            """Each module's norm and the global one, from one world MAX that carries the found-inf flag too;
            returns whether any rank found one. The step's one wait for the GPU."""
            names = sorted(self.module_infos)
            reduced = torch.zeros(len(names) + 1, device="cuda", dtype=torch.float32)
            for i, name in enumerate(names):
                info = self.module_infos[name]
                if info.is_active and info.optimizer:
                    # with transformer-engine's kernels megatron-core returns the norm as a device tensor: copied
                    # in on the device, never tested for truth (`norm or 0.0` waited for the GPU once per module)
                    norm = info.optimizer.get_grad_norm()
                    if norm is not None:
                        reduced[i] = norm ** 2
            reduced[-1].fill_(float(found_inf))  # a kernel; assigning a Python number copies it in and waits
            torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX)
            *norm_sq, any_inf = reduced.tolist()
            self.module_grad_norms = {name: math.sqrt(n) for name, n in zip(names, norm_sq)}
            self.grad_norm = math.sqrt(sum(norm_sq))
            return any_inf > 0

    return RecordingMimoOptimizer


def build_optimizer(options: OptimizerOptions, *, model, params_dtype: torch.dtype):
    from megatron.core.models.mimo.optimizer import get_mimo_optimizer
    from megatron.core.optimizer import OptimizerConfig

    config = OptimizerConfig(
        optimizer="adam", lr=options.lr, min_lr=options.min_lr, weight_decay=options.weight_decay,
        adam_beta1=options.adam_beta1, adam_beta2=options.adam_beta2, adam_eps=options.adam_eps,
        clip_grad=options.clip_grad, bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype,
        use_distributed_optimizer=options.use_distributed_optimizer, **precision_aware(options.optimizer_precision),
    )
    # megatron-core builds one optimizer per module grid; the global grad norm and clipping span all of them.
    built = get_mimo_optimizer(model, config)
    for name in _frozen_everywhere(model, sorted(built.module_infos)):
        built.module_infos[name].optimizer = None  # nothing to step, no state to keep or checkpoint
    for info in built.module_infos.values():
        info.optimizer = _without_stub_parts(info.optimizer)
    _copy_main_params_in_one_kernel(info.optimizer for info in built.module_infos.values())
    return _recording_optimizer_class()(built.module_infos, built.config)


def precision_aware(optimizer_precision: str) -> dict:
    """OptimizerConfig's fields for --optimizer-precision: megatron-core's precision-aware optimizer keeps Adam's
    moments (and with "bf16" the gradients) in bf16, and the fp32 main weights as the bf16 weights plus 16-bit
    remainders (store_param_remainders), inside transformer-engine's FusedAdam."""
    if optimizer_precision == "fp32":
        return {}
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: F401
    except ImportError:
        raise UsageError(f"--optimizer-precision {optimizer_precision} needs transformer-engine's FusedAdam, which "
                         "is not importable here: install mimo's te extra (pip install '.[te]') or use "
                         "--optimizer-precision fp32") from None
    bf16 = torch.bfloat16
    return dict(use_precision_aware_optimizer=True, store_param_remainders=True, exp_avg_dtype=bf16,
                exp_avg_sq_dtype=bf16, main_grads_dtype=bf16 if optimizer_precision == "bf16" else torch.float32)


def _without_stub_parts(optimizer):
    """A module whose trainable parameters are all routed experts' (adapters on the experts alone) gets a stub for
    its empty dense part from megatron-core, beside the experts' optimizer; their chain then fails at the first save
    (it reads the stub's missing param_groups to align the steps). The chain keeps its parts that have parameters:
    the same on every rank, as a part is empty where its parameters are frozen in the whole run."""
    from megatron.core.optimizer import ChainedOptimizer

    parts = getattr(optimizer, "chained_optimizers", None)
    if not parts or len(parts) < 2:
        return optimizer
    kept = [part for part in parts if not getattr(part, "is_stub_optimizer", False)]
    return ChainedOptimizer(kept) if kept and len(kept) < len(parts) else optimizer


def _copy_main_params_in_one_kernel(module_optimizers) -> None:
    """megatron-core copies a bf16 run's fp32 main weights into the model's weights with one `copy_` per parameter
    (its multi-tensor path needs a flag buffer it makes only for fp16): a kernel and a launch per parameter each
    iteration. Handing its optimizers that buffer makes the copy transformer-engine's (or apex's) multi-tensor
    kernel: the same values, a scale by 1.0 rounded to bf16 as `copy_` rounds (mimo's model weights are plain bf16
    tensors; only megatron-core's Float16 optimizer reads the buffer)."""
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.utils import local_multi_tensor_scale

    if megatron_optimizer.multi_tensor_scale_impl is local_multi_tensor_scale:
        return  # no fused kernel: megatron-core's stand-in copies tensor by tensor too
    for optimizer in filter(None, module_optimizers):
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            if getattr(inner, "_dummy_overflow_buf", False) is not None or not inner.config.bf16:
                continue  # fp16's has the buffer already; fp32 copies nothing
            params = inner.get_parameters()
            if params and params[0].is_cuda:
                inner._dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device=params[0].device)


def _frozen_everywhere(model, names: list[str]) -> list[str]:
    """Modules with no trainable parameter on any rank (world collective)."""
    from .model import held_modules

    trainable = dict.fromkeys(names, 0)
    for name, module in held_modules(model):
        trainable[name] = sum(p.numel() for p in module.parameters() if p.requires_grad)
    counts = torch.tensor([trainable[n] for n in names], dtype=torch.int64,
                          device=next(model.parameters()).device)
    torch.distributed.all_reduce(counts)
    return [n for n, c in zip(names, counts.tolist()) if c == 0]


def schedule_samples(options: SchedulerOptions, global_batch_size: int, train_samples: int) -> dict[str, int]:
    """The schedule's phases in samples (megatron-core's steps): warmup, decay (default: the whole run), WSD's
    final decay (0: none)."""
    def samples(iters, count, default=0):
        return count if count else (iters * global_batch_size if iters else default)

    return {"warmup": samples(options.lr_warmup_iters, options.lr_warmup_samples),
            "decay": max(samples(options.lr_decay_iters, options.lr_decay_samples, train_samples), 1),
            "wsd_decay": samples(options.lr_wsd_decay_iters, options.lr_wsd_decay_samples)}


def check_schedule(options: SchedulerOptions, global_batch_size: int, train_samples: int) -> None:
    """megatron-core's scheduler asserts warmup < decay: say so in one line, in the warmup option's units."""
    phases = schedule_samples(options, global_batch_size, train_samples)
    if phases["warmup"] < phases["decay"]:
        return
    warmup, per = (("--lr-warmup-samples", 1) if options.lr_warmup_samples
                   else ("--lr-warmup-iters", global_batch_size))
    decay = ("--lr-decay-iters" if options.lr_decay_iters else "--lr-decay-samples" if options.lr_decay_samples
             else "the whole run")
    raise UsageError(f"{warmup} {phases['warmup'] // per} is not shorter than the learning-rate decay ({decay}: "
                     f"{phases['decay'] / per:g} in the same units): shorten the warmup or lengthen the decay")


def build_scheduler(options: SchedulerOptions, *, optimizer, optimizer_options: OptimizerOptions,
                    global_batch_size: int, train_samples: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    phases = schedule_samples(options, global_batch_size, train_samples)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=optimizer_options.lr,
        min_lr=optimizer_options.min_lr,
        lr_warmup_steps=phases["warmup"],
        lr_decay_steps=phases["decay"],
        lr_decay_style=options.lr_decay_style,
        start_wd=optimizer_options.weight_decay,
        end_wd=optimizer_options.weight_decay,
        wd_incr_steps=max(train_samples, 1),
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False,
        wsd_decay_steps=phases["wsd_decay"] or None,
        lr_wsd_decay_style=options.lr_wsd_decay_style,
    )
