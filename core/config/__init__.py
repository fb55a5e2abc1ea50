"""The loop's options, one dataclass per component (loop.py: what it runs; speed.py: how GPU time and memory are
spent), and RunConfig, which holds one of each. Provider settings live with each provider, never here.

Each component's options check their own fields (`validate`); RunConfig.validate runs those and checks only what
crosses components. Each field's `help` is its `mimo run --help` text: the CLI builds its options from these
dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mimo.errors import UsageError

from .adapters import AdapterOptions
from .loop import (CheckpointOptions, DataOptions, EvalOptions, LaunchOptions, LayoutOptions, LoggingOptions,
                   OptimizerOptions, SchedulerOptions, TrainingOptions)
from .option import Options, option
from .speed import CUDA_GRAPH_MODULES, RECOMPUTE_MODES, CompileOptions, MemoryOptions, PerformanceOptions

__all__ = [
    "COMPONENTS", "AdapterOptions", "CUDA_GRAPH_MODULES", "DEFAULT_TRAIN_ITERS", "RECOMPUTE_MODES",
    "CheckpointOptions", "CompileOptions", "Component", "DataOptions", "EvalOptions", "LaunchOptions",
    "LayoutOptions", "LoggingOptions", "MemoryOptions", "OptimizerOptions", "Options", "PerformanceOptions",
    "RunConfig", "SchedulerOptions", "TrainingOptions", "option",
]


DEFAULT_TRAIN_ITERS = 100


@dataclass(frozen=True)
class Component:
    """One component's options: `RunConfig.<name>`, shown under `heading` in `mimo run --help`."""

    name: str
    heading: str
    options: type


# The loop's components, in `--help` order. A new options dataclass is one entry here: RunConfig gets a field of
# that name and the CLI its options under that heading (cli/options.py reads this list).
COMPONENTS = (
    Component("launch", "Launch", LaunchOptions),
    Component("training", "Training", TrainingOptions),
    Component("optimizer", "Optimizer", OptimizerOptions),
    Component("scheduler", "Learning-rate schedule", SchedulerOptions),
    Component("data", "Data", DataOptions),
    Component("evaluation", "Evaluation", EvalOptions),
    Component("logging", "Logging", LoggingOptions),
    Component("checkpoint", "Checkpoints", CheckpointOptions),
    Component("layout", "Parallel layout", LayoutOptions),
    Component("adapters", "Adapters (LoRA)", AdapterOptions),
    Component("performance", "Performance", PerformanceOptions),
    Component("memory", "Memory", MemoryOptions),
    Component("compile", "Compilation", CompileOptions),
)


def _with_components(cls):
    """Give the run's config one field per component (default: that component's defaults), then make it a
    dataclass: `RunConfig(provider=..., training=TrainingOptions(...))`, `config.training.seed`."""
    for component in COMPONENTS:
        cls.__annotations__[component.name] = component.options
        setattr(cls, component.name, field(default_factory=component.options))
    return dataclass(cls)


@_with_components
class RunConfig:
    """Everything `mimo run` was told: the provider, its settings, and each component's options (COMPONENTS)."""

    provider: str
    provider_settings: list[str] = field(default_factory=list)  # `--set key=value` assignments
    provider_config: Path | None = None
    provider_values: dict = field(default_factory=dict)  # the `settings:` section of a --config file
    config_file: Path | None = None  # that --config file

    def validate(self) -> None:
        """Checks that need nothing but the options themselves: each component's own, then those across them."""
        for component in COMPONENTS:
            getattr(self, component.name).validate()
        p, precision = self.performance, self.training.precision
        if p.overlap_param_gather and not (self.optimizer.use_distributed_optimizer and p.overlap_grad_reduce):
            raise UsageError("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce")
        if p.fp8 != "none" and precision != "bf16":
            raise UsageError(f"--fp8 {p.fp8} needs --precision bf16 (FP8 keeps bf16 weights and activations)")
        o = self.optimizer
        if o.optimizer_precision != "fp32":
            needs = [need for need, missing in (("--precision bf16", precision != "bf16"),
                                                ("--use-distributed-optimizer", not o.use_distributed_optimizer),
                                                ("a GPU (--device cuda)", self.training.device == "cpu")) if missing]
            if needs:
                raise UsageError(f"--optimizer-precision {o.optimizer_precision} needs {' and '.join(needs)} "
                                 "(megatron-core's precision-aware optimizer: transformer-engine's FusedAdam on a "
                                 "GPU, state sharded by the distributed optimizer)")
        if self.logging.memory_snapshot_dir and self.training.device == "cpu":
            raise UsageError("--memory-snapshot-dir records the GPU allocator: drop it, or use --device cuda")
        if self.training.init_device == "cuda" and self.training.device == "cpu":
            raise UsageError("--init-device cuda needs a GPU run: drop it, or use --device cuda")
        if p.cuda_graphs and precision != "bf16":
            raise UsageError("--cuda-graphs needs --precision bf16 (megatron-core captures the layers with bf16 "
                             "inputs)")
