"""The loop's options, one dataclass per component. Provider settings live with each provider, never here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mimo.errors import UsageError


@dataclass
class TrainingOptions:
    micro_batch_size: int = 4
    global_batch_size: int | None = None  # default: micro_batch_size x data-parallel size (one micro-batch)
    train_iters: int | None = None
    train_samples: int | None = None
    seed: int = 1234
    precision: Literal["fp32", "bf16"] = "fp32"
    device: Literal["auto", "cuda", "cpu"] = "auto"


@dataclass
class OptimizerOptions:
    lr: float = 1e-3
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass
class SchedulerOptions:
    """Learning-rate schedule; lengths in iterations or in samples (one of each pair)."""

    lr_decay_style: Literal["constant", "linear", "cosine", "WSD"] = "constant"
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_decay_iters: int | None = None  # default: the whole run
    lr_decay_samples: int | None = None
    lr_wsd_decay_iters: int | None = None  # WSD: length of the final decay phase
    lr_wsd_decay_samples: int | None = None
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"


@dataclass
class LoggingOptions:
    log_interval: int = 10
    metrics_file: Path | None = None


@dataclass
class LayoutOptions:
    """Which ranks run which module, and how each module's ranks split (validated before any process group)."""

    encoder_ranks: int = 0  # 0: colocated, every module on every rank
    encoder_tp: int = 1
    llm_tp: int = 1
    llm_pp: int = 1
    llm_ep: int = 1
    llm_expt_tp: int = 1
    num_microbatches: int | None = None  # default: derived from the global batch size


@dataclass
class RunConfig:
    provider: str
    provider_settings: list[str] = field(default_factory=list)  # `--set key=value` assignments
    provider_config: Path | None = None
    training: TrainingOptions = field(default_factory=TrainingOptions)
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    logging: LoggingOptions = field(default_factory=LoggingOptions)
    layout: LayoutOptions = field(default_factory=LayoutOptions)

    def validate(self) -> None:
        """Checks that need nothing but the options themselves."""
        t, s = self.training, self.scheduler
        if (t.train_iters is None) == (t.train_samples is None):
            raise UsageError("give exactly one of --train-iters and --train-samples")
        for name, value in (("--micro-batch-size", t.micro_batch_size), ("--log-interval", self.logging.log_interval),
                            ("--train-iters", t.train_iters), ("--train-samples", t.train_samples)):
            if value is not None and value < 1:
                raise UsageError(f"{name} must be at least 1, got {value}")
        if s.lr_warmup_iters and s.lr_warmup_samples:
            raise UsageError("give at most one of --lr-warmup-iters and --lr-warmup-samples")
        if s.lr_decay_iters is not None and s.lr_decay_samples is not None:
            raise UsageError("give at most one of --lr-decay-iters and --lr-decay-samples")
        if s.lr_decay_style == "WSD" and s.lr_wsd_decay_iters is None and s.lr_wsd_decay_samples is None:
            raise UsageError("--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples")
        if self.optimizer.min_lr > self.optimizer.lr:
            raise UsageError(f"--min-lr {self.optimizer.min_lr} is above --lr {self.optimizer.lr}")
