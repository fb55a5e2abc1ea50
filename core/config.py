"""The loop's options, one dataclass per component. Provider settings live with each provider, never here.

Each field's `help` is its `mimo run --help` text: the CLI builds its options from these dataclasses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Literal

from mimo.errors import UsageError


def option(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainingOptions:
    micro_batch_size: int = option(4, "samples per micro-batch on each data-parallel lane")
    global_batch_size: int | None = option(None, "samples per iteration (default: micro-batch size x LLM DP)")
    train_iters: int | None = option(None, "iterations to train (default: 100, unless --train-samples is given)")
    train_samples: int | None = option(None, "samples to train; iterations = samples / global batch size")
    seed: int = option(1234, "seed for weights, data order and dropout: the same seed repeats a run")
    precision: Literal["fp32", "bf16"] = option("fp32", "parameter and compute precision")
    device: Literal["auto", "cuda", "cpu"] = option("auto", "auto uses CUDA when a GPU is visible")
    num_microbatches: int | None = option(None, "micro-batches per iteration (sets the global batch size)")


@dataclass
class OptimizerOptions:
    lr: float = option(1e-3, "peak learning rate")
    min_lr: float = option(0.0, "learning rate at the end of the decay")
    weight_decay: float = option(0.01, "Adam weight decay (not applied to biases and norms)")
    adam_beta1: float = option(0.9, "Adam beta1")
    adam_beta2: float = option(0.999, "Adam beta2")
    adam_eps: float = option(1e-8, "Adam epsilon")
    clip_grad: float = option(1.0, "clip the global gradient norm (across all modules) to this; 0 disables")
    use_distributed_optimizer: bool = option(False, "shard optimizer state over data-parallel ranks (ZeRO-1)")


@dataclass
class SchedulerOptions:
    lr_decay_style: Literal["constant", "linear", "cosine", "WSD"] = option("constant", "learning-rate decay")
    lr_warmup_iters: int = option(0, "linear warmup length in iterations")
    lr_warmup_samples: int = option(0, "linear warmup length in samples")
    lr_decay_iters: int | None = option(None, "decay length in iterations (default: the whole run)")
    lr_decay_samples: int | None = option(None, "decay length in samples (default: the whole run)")
    lr_wsd_decay_iters: int | None = option(None, "WSD: iterations of the final decay phase")
    lr_wsd_decay_samples: int | None = option(None, "WSD: samples of the final decay phase")
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = option(
        "linear", "WSD: shape of the final decay phase")


@dataclass
class DataOptions:
    data: Path | None = option(None, "an energon dataset directory or metadataset file (default: the provider's "
                                     "synthetic data)")
    num_workers: int = option(2, "data loader worker processes per data lane")
    prefetch_microbatches: int = option(
        2, "micro-batches a background thread prepares ahead (providers' own data; --data loaders have workers); "
           "with --encoder-pass step at least a step's; 0: none")
    pack_sequences: bool = option(
        True, "pack several --data samples into each sequence (THD: positions restart and attention stays within a "
              "sample); a micro-batch then holds micro-batch-size packed sequences")
    packing_buffer_size: int = option(64, "--data samples read ahead per data lane to choose packs from")
    max_skip_fraction: float = option(
        0.1, "stop the run (exit 2, saving first with --save) when more than this share of the --data samples read "
             "were skipped (unreadable, unsupported or too long), checked once 100 have been read; 1: never")
    truncation_warning: float = option(
        0.05, "warn when seq_length cuts more than this share of the answer tokens read in a logging interval; 1: never")


@dataclass
class EvalOptions:
    eval_interval: int | None = option(None, "iterations between held-out evaluations (default: none during the "
                                             "run; with --eval-iters, one at the end)")
    eval_iters: int = option(0, "global batches each evaluation reads (0: no evaluation)")
    eval_at_start: bool = option(False, "also evaluate before the first training iteration")
    eval_data: Path | None = option(None, "evaluate on this energon dataset or metadataset's val split (default: "
                                          "the val split of --data; without --data, the provider's synthetic data "
                                          "from a fixed seed of its own)")
    eval_samples: int = option(0, "at each evaluation, also generate answers (greedy) to the first N answer turns "
                                  "of the eval split and score them against its answers (exact match, token F1)")
    eval_max_new_tokens: int = option(64, "--eval-samples: the longest answer, in tokens")

    def validate(self) -> None:
        if self.eval_samples < 0 or self.eval_max_new_tokens < 1:
            raise UsageError(f"--eval-samples must be 0 or more and --eval-max-new-tokens at least 1, got "
                             f"{self.eval_samples} and {self.eval_max_new_tokens}")
        if self.eval_samples and not self.eval_iters:
            raise UsageError("--eval-samples needs --eval-iters K (predictions are made at each evaluation)")
        if self.eval_iters < 0:
            raise UsageError(f"--eval-iters must be 0 or more, got {self.eval_iters}")
        if self.eval_interval is not None and self.eval_interval < 1:
            raise UsageError(f"--eval-interval must be at least 1, got {self.eval_interval}")
        if (self.eval_interval or self.eval_at_start or self.eval_data) and not self.eval_iters:
            raise UsageError("--eval-interval, --eval-at-start and --eval-data need --eval-iters K (the global "
                             "batches each evaluation reads)")
        if self.eval_data is not None and not self.eval_data.exists():
            raise UsageError(f"--eval-data {self.eval_data}: no such file or directory")


@dataclass
class LoggingOptions:
    log_interval: int = option(10, "iterations between log lines")
    metrics_file: Path | None = option(None, "append one JSON object per logged iteration to this file")
    tensorboard_dir: Path | None = option(None, "write TensorBoard scalars here (Megatron's names)")
    log_timers: bool = option(False, "time data, forward, backward, bridge and optimizer per module (syncs GPUs)")
    peak_tflops: float | None = option(None, "the GPU's dense bf16 peak TFLOP/s for MFU (default: known GPUs)")
    flop_check_iteration: int | None = option(
        None, "count this iteration's FLOPs with torch's counter and compare with the provider's model_flops")
    max_nan_iters: int = option(10, "stop after this many iterations in a row with a non-finite loss or grad norm")
    profile_dir: Path | None = option(
        None, "profile iterations --profile-step-start..--profile-step-end with torch.profiler: a trace and a "
              "summary per rank here, and where the GPU time went in the log")
    profile_step_start: int = option(5, "first profiled iteration (after warm-up)")
    profile_step_end: int = option(6, "last profiled iteration")
    profile_with_stack: bool = option(
        False, "record Python stacks in the profile: the summary names the source line that launched each of the "
               "busiest kernels (the profiled iterations' host side runs slower)")


@dataclass
class LaunchOptions:
    nproc_per_node: int = option(1, "worker processes to start on this node (under torchrun/srun: ignored)")
    nnodes: int = option(1, "nodes in the run; each starts mimo run with the same options")
    rdzv_endpoint: str | None = option(None, "host:port where the nodes meet (multi-node; default: this host)")
    rdzv_id: str = option("mimo", "run id shared by the nodes of one run")
    distributed_timeout_minutes: float = option(10.0, "a collective waiting longer (e.g. a rank died) fails the run")
    exit_signal: Literal["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"] = option(
        "SIGTERM", "on this signal (or SIGINT) every rank stops at the next iteration boundary, saves when --save is "
                   "set, and exits 1 (SLURM preempts with SIGTERM; sbatch --signal can send SIGUSR1 earlier)")


@dataclass
class CheckpointOptions:
    save: Path | None = option(None, "save checkpoints here (Megatron layout: iter_NNNNNNN/ and a tracker file)")
    save_interval: int | None = option(None, "iterations between saves (default: only at the end)")
    load: Path | None = option(None, "resume from the latest checkpoint here, if there is one")
    pretrained: Path | None = option(None, "start from these weights (strict) when --load has no checkpoint")
    pretrained_llm: Path | None = option(
        None, "a Hugging Face folder of the language model alone (e.g. nemotron_h) to start it from, when --load has "
              "no checkpoint; its config.json's settings are the run's; with --pretrained-vision, a VLM from parts "
              "(the rest starts from initialization)")
    pretrained_vision: Path | None = option(
        None, "a Hugging Face folder of the vision encoder alone (e.g. radio) to start it from, as --pretrained-llm")
    finetune: bool = option(False, "load weights only; iteration, optimizer, schedule and data start anew")
    # Megatron's --no-save-optim etc., as --x / --no-x pairs (a field named no_x would read --no-no-x).
    save_optim: bool = option(True, "save optimizer state with the weights (--no-save-optim: weights only)")
    load_optim: bool = option(True, "load optimizer state (--no-load-optim: start a fresh optimizer)")
    load_scheduler: bool = option(True, "load the learning-rate schedule's state")
    save_rng: bool = option(True, "save RNG states")
    load_rng: bool = option(True, "load RNG states")
    dist_ckpt_optim_fully_reshardable: bool = option(
        False, "save distributed-optimizer state so it loads at any data-parallel size")
    ckpt_assume_constant_structure: bool = option(
        False, "reuse the first save's plan for later saves (faster; the state's structure must not change)")
    async_save: bool = option(False, "write checkpoints in the background while training goes on")
    keep_last: int | None = option(None, "keep only the newest N checkpoints (never the one the tracker names)")


@dataclass
class LayoutOptions:
    """Which ranks run which module and how each module's ranks split; checked before any process group."""

    encoder_ranks: int = option(0, "ranks for the encoders, the LLM gets the rest (0: colocated on all ranks)")
    encoder_tp: int = option(1, "tensor parallelism of the encoders")
    llm_tp: int = option(1, "tensor parallelism of the LLM")
    llm_pp: int = option(1, "pipeline parallelism of the LLM")
    llm_ep: int = option(1, "expert parallelism of the LLM")
    llm_expt_tp: int = option(1, "tensor parallelism of the LLM's experts")


RECOMPUTE_MODES = ("none", "selective", "full")
CUDA_GRAPH_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")  # megatron's CudaGraphModule


@dataclass
class PerformanceOptions:
    """How the GPU time is spent: recomputation, overlapped communication, sequence parallelism, FP8, CUDA graphs.
    The loop sets them in every module's TransformerConfig and DDP config; providers choose only kernels."""

    recompute: str = option(
        "none", "recompute activations in backward instead of keeping them: none; selective (megatron-core's "
                "memory-heavy, compute-light parts: core attention, MoE and MLP activations, norms); full (each "
                "layer's input only). One mode for all modules, or per module: language=full,images=selective")
    sequence_parallel: bool = option(
        False, "split the LLM's norms, dropout and residual activations over its TP ranks (Megatron's sequence "
               "parallelism); needed for a mixture-of-experts LLM under --llm-tp > 1")
    overlap_grad_reduce: bool = option(False, "reduce gradients bucket by bucket during the last micro-batch's "
                                              "backward instead of after it")
    overlap_param_gather: bool = option(False, "distributed optimizer: gather the updated parameters during the "
                                               "next forward instead of after the step (needs "
                                               "--use-distributed-optimizer and --overlap-grad-reduce)")
    fp8: Literal["none", "tensorwise", "delayed", "blockwise"] = option(
        "none", "the LLM's matrix multiplies in FP8 with transformer-engine's recipe of this name (E4M3 "
                "forward, E5M2 gradients); needs --precision bf16, a provider backend te and a Hopper or newer GPU")
    cuda_graphs: bool = option(False, "capture each transformer layer's forward and backward as CUDA graphs "
                                      "(megatron-core with transformer-engine; fixed sequence shapes only)")
    cuda_graph_modules: str | None = option(
        None, "with --cuda-graphs: which parts of the LLM's layers to capture, megatron-core's names separated by "
              "commas (attn, mlp, moe, moe_router, moe_preprocess, mamba); default: the provider's choice")
    encoder_pass: Literal["auto", "step", "micro-batch"] = option(
        "auto", "run the encoders once per step on every micro-batch's images (step: one launch of each encoder "
                "kernel per step; the encoders' activations of the whole step are kept) or once per micro-batch; "
                "auto: step on a GPU where the layout allows it (colocated encoders)")
    gc_interval: int = option(
        0, "Python's garbage collector during training: 0 leaves it as it is; N freezes the objects built before "
           "the first iteration (no pass walks them again), turns its own passes off and collects at the end of "
           "every N-th iteration, on every rank at once (the logs' gc ms/iter says what it costs)")
    grad_accum_fusion: bool = option(
        True, "layers add their weight gradients into the fp32 gradient buffer where they compute them "
              "(transformer-engine's inside the GEMM; megatron-core's output layer, linears and embedding at TP 1 "
              "too); --no-grad-accum-fusion: a separate add per weight and micro-batch")

    def recompute_modes(self) -> dict[str, str]:
        """{module or "*": mode} from --recompute; "*" is every module not named."""
        text = self.recompute.strip()
        if "=" not in text:
            modes = {"*": text}
        else:
            modes = {}
            for part in filter(None, (p.strip() for p in text.split(","))):
                module, sep, mode = part.partition("=")
                if not sep or not module.strip():
                    raise UsageError(f"--recompute {self.recompute!r}: write MODE or MODULE=MODE,MODULE=MODE")
                modes[module.strip()] = mode.strip()
        for mode in modes.values():
            if mode not in RECOMPUTE_MODES:
                raise UsageError(f"--recompute: unknown mode {mode!r}; choose among {', '.join(RECOMPUTE_MODES)}")
        return modes

    def recompute_for(self, module: str) -> str:
        modes = self.recompute_modes()
        return modes.get(module, modes.get("*", "none"))

    def validate(self, optimizer: OptimizerOptions, precision: str) -> None:
        self.recompute_modes()
        if self.gc_interval < 0:
            raise UsageError(f"--gc-interval must be 0 (automatic collection) or a number of iterations, got "
                             f"{self.gc_interval}")
        if self.overlap_param_gather and not (optimizer.use_distributed_optimizer and self.overlap_grad_reduce):
            raise UsageError("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce")
        if self.fp8 != "none" and precision != "bf16":
            raise UsageError(f"--fp8 {self.fp8} needs --precision bf16 (FP8 keeps bf16 weights and activations)")
        if self.cuda_graphs and precision != "bf16":
            raise UsageError("--cuda-graphs needs --precision bf16 (megatron-core captures the layers with bf16 "
                             "inputs)")
        if self.cuda_graph_modules is not None:
            if not self.cuda_graphs:
                raise UsageError("--cuda-graph-modules needs --cuda-graphs")
            self.graph_modules()

    def graph_modules(self) -> tuple[str, ...] | None:
        """--cuda-graph-modules as megatron-core's capture names, or None for the provider's choice."""
        if self.cuda_graph_modules is None:
            return None
        names = tuple(filter(None, (n.strip() for n in self.cuda_graph_modules.split(","))))
        unknown = [n for n in names if n not in CUDA_GRAPH_MODULES]
        if unknown or not names:
            raise UsageError(f"--cuda-graph-modules: unknown name {unknown[0] if unknown else repr('')}; choose "
                             f"among {', '.join(CUDA_GRAPH_MODULES)}")
        return names


@dataclass
class MemoryOptions:
    gpu_memory: float | None = option(
        None, "GiB of memory per GPU the run may use: a layout whose estimate does not fit is refused before "
              "start (default: the visible GPU's, else 80)")
    image_patches: str = option(
        "max", "image tokens per sample the memory estimate assumes for the encoders: max (every image at its "
               "largest, the default: never too low), mean (the provider's average image), or a number")

    def encoder_tokens(self) -> str | float:
        """--image-patches as "max", "mean" or a positive number of tokens per sample."""
        if self.image_patches in ("max", "mean"):
            return self.image_patches
        try:
            value = float(self.image_patches)
        except ValueError:
            value = -1.0
        if not value > 0 or not math.isfinite(value):
            raise UsageError(f"--image-patches must be max, mean or a positive number, got {self.image_patches!r}")
        return value


@dataclass
class CompileOptions:
    """What is compiled at the first iterations, and where it is kept for the next run."""

    torch_compile: Literal["off", "on"] = option(
        "off", "run megatron-core's fused functions through torch.compile (on) or eagerly (off: measured faster "
               "on an H100, and no inductor compile at the first iterations)")
    compile_cache: Path | None = option(
        None, "keep compiled GPU kernels here for later runs: Triton's (with its autotuning), inductor's, and the "
              "kernel choices mimo pins (default: $MIMO_COMPILE_CACHE, else ~/.cache/mimo/compile; the nodes of a "
              "cluster job may share one)")
    kernel_configs: str | None = option(
        None, "a JSON table of Triton autotune choices to pin besides the provider's and the cache's; none: pin "
              "nothing, every kernel autotunes")


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
        """Checks that need nothing but the options themselves."""
        t, s = self.training, self.scheduler
        _check_finite(self)
        if t.train_iters is not None and t.train_samples is not None:
            raise UsageError("give at most one of --train-iters and --train-samples")
        for name, value in (("--micro-batch-size", t.micro_batch_size), ("--log-interval", self.logging.log_interval),
                            ("--train-iters", t.train_iters), ("--train-samples", t.train_samples),
                            ("--global-batch-size", t.global_batch_size), ("--num-microbatches", t.num_microbatches),
                            ("--nproc-per-node", self.launch.nproc_per_node), ("--nnodes", self.launch.nnodes)):
            if value is not None and value < 1:
                raise UsageError(f"{name} must be at least 1, got {value}")
        if t.global_batch_size is not None and t.num_microbatches is not None:
            raise UsageError("give at most one of --global-batch-size and --num-microbatches")
        if self.launch.nnodes > 1 and not self.launch.rdzv_endpoint:
            raise UsageError("--nnodes > 1 needs --rdzv-endpoint host:port, the same on every node")
        if self.logging.max_nan_iters < 1:
            raise UsageError(f"--max-nan-iters must be at least 1, got {self.logging.max_nan_iters}")
        lg = self.logging
        if lg.profile_dir and not 1 <= lg.profile_step_start <= lg.profile_step_end:
            raise UsageError(f"--profile-step-start {lg.profile_step_start} and --profile-step-end "
                             f"{lg.profile_step_end} must satisfy 1 <= start <= end")
        if lg.profile_with_stack and not lg.profile_dir:
            raise UsageError("--profile-with-stack records stacks in a profile: add --profile-dir DIR")
        if self.data.prefetch_microbatches < 0:
            raise UsageError(f"--prefetch-microbatches must be 0 or more, got {self.data.prefetch_microbatches}")
        if not 0 <= self.data.max_skip_fraction <= 1:
            raise UsageError(f"--max-skip-fraction must lie between 0 and 1, got {self.data.max_skip_fraction}")
        if not 0 <= self.data.truncation_warning <= 1:
            raise UsageError(f"--truncation-warning must lie between 0 and 1, got {self.data.truncation_warning}")
        if self.data.packing_buffer_size < 1:
            raise UsageError(f"--packing-buffer-size must be 1 or more, got {self.data.packing_buffer_size}")
        if self.data.num_workers < 0:
            raise UsageError(f"--num-workers must be 0 or more, got {self.data.num_workers}")
        c = self.checkpoint
        if c.pretrained and (c.pretrained_llm or c.pretrained_vision):
            raise UsageError("give --pretrained (a whole model) or its parts (--pretrained-llm, --pretrained-vision), "
                             "not both")
        if self.data.data is not None and not self.data.data.exists():
            raise UsageError(f"--data {self.data.data}: no such file or directory")
        self.evaluation.validate()
        self.performance.validate(self.optimizer, t.precision)
        if self.memory.gpu_memory is not None and not self.memory.gpu_memory > 0:
            raise UsageError(f"--gpu-memory must be a positive number of GiB, got {self.memory.gpu_memory}")
        self.memory.encoder_tokens()
        kc = self.compile.kernel_configs
        if kc is not None and kc != "none" and not Path(kc).is_file():
            raise UsageError(f"--kernel-configs {kc}: no such file (a table mimo wrote, or none)")
        c = self.checkpoint
        for name, value in (("--save-interval", c.save_interval), ("--keep-last", c.keep_last)):
            if value is not None and value < 1:
                raise UsageError(f"{name} must be at least 1, got {value}")
        if c.save_interval and not c.save:
            raise UsageError("--save-interval needs --save DIR")
        if c.finetune and not c.load:
            raise UsageError("--finetune needs --load DIR (the checkpoint whose weights to start from)")
        if s.lr_warmup_iters and s.lr_warmup_samples:
            raise UsageError("give at most one of --lr-warmup-iters and --lr-warmup-samples")
        if s.lr_decay_iters is not None and s.lr_decay_samples is not None:
            raise UsageError("give at most one of --lr-decay-iters and --lr-decay-samples")
        if s.lr_decay_style == "WSD" and s.lr_wsd_decay_iters is None and s.lr_wsd_decay_samples is None:
            raise UsageError("--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples")
        if self.optimizer.min_lr > self.optimizer.lr:
            raise UsageError(f"--min-lr {self.optimizer.min_lr} is above --lr {self.optimizer.lr}")


def _check_finite(config: RunConfig) -> None:
    """nan or inf in a numeric option would surface deep in a library as a traceback, or never (a nan lr trains)."""
    for part in (getattr(config, f.name) for f in fields(config)):
        if is_dataclass(part):
            for f in fields(part):
                value = getattr(part, f.name)
                if isinstance(value, float) and not math.isfinite(value):
                    raise UsageError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
