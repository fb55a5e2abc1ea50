"""The options of the loop's components that say what it runs: how long and on which batches, the optimizer and
its schedule, the data, evaluation, logging, launch, checkpoints and the parallel layout. Each validates its own
fields (`Options.validate`); what crosses components is RunConfig.validate's.

Each field's `help` is its `mimo run --help` text: the CLI builds its options from these dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mimo.errors import UsageError

from .option import Options, at_least_one, option


@dataclass
class TrainingOptions(Options):
    micro_batch_size: int = option(4, "samples per micro-batch on each data-parallel lane")
    global_batch_size: int | None = option(None, "samples per iteration (default: micro-batch size x LLM DP)")
    train_iters: int | None = option(None, "iterations to train (default: 100, unless --train-samples is given)")
    train_samples: int | None = option(None, "samples to train; iterations = samples / global batch size")
    seed: int = option(1234, "seed for weights, data order and dropout: the same seed repeats a run")
    precision: Literal["fp32", "bf16"] = option("fp32", "parameter and compute precision")
    device: Literal["auto", "cuda", "cpu"] = option("auto", "auto uses CUDA when a GPU is visible")
    num_microbatches: int | None = option(None, "micro-batches per iteration (sets the global batch size)")
    init_device: Literal["auto", "cpu", "cuda"] = option(
        "auto", "where the initial weights are drawn. cpu: the same weights in any layout, slowly (torch's CPU "
        "generator is serial: minutes for billions of parameters); cuda: seconds, the same weights in layouts of "
        "equal TP, EP and expert TP; auto: cuda on GPUs")

    def check(self) -> None:
        if self.train_iters is not None and self.train_samples is not None:
            raise UsageError("give at most one of --train-iters and --train-samples")
        at_least_one(("--micro-batch-size", self.micro_batch_size), ("--train-iters", self.train_iters),
                     ("--train-samples", self.train_samples), ("--global-batch-size", self.global_batch_size),
                     ("--num-microbatches", self.num_microbatches))
        if self.global_batch_size is not None and self.num_microbatches is not None:
            raise UsageError("give at most one of --global-batch-size and --num-microbatches")


@dataclass
class OptimizerOptions(Options):
    lr: float = option(1e-3, "peak learning rate")
    min_lr: float = option(0.0, "learning rate at the end of the decay")
    weight_decay: float = option(0.01, "Adam weight decay (not applied to biases and norms)")
    adam_beta1: float = option(0.9, "Adam beta1")
    adam_beta2: float = option(0.999, "Adam beta2")
    adam_eps: float = option(1e-8, "Adam epsilon")
    clip_grad: float = option(1.0, "clip the global gradient norm (across all modules) to this; 0 disables")
    use_distributed_optimizer: bool = option(False, "shard optimizer state over data-parallel ranks (ZeRO-1)")
    optimizer_precision: Literal["fp32", "bf16-moments", "bf16"] = option(
        "fp32", "a bf16 run's optimizer: fp32 (main weights, Adam moments and gradients in fp32: 16 bytes a "
        "parameter besides its bf16 weight); bf16-moments (moments in bf16, main weights as the bf16 weights plus "
        "16-bit remainders: 10); bf16 (that and gradients reduced in bf16: 8). megatron-core's precision-aware "
        "optimizer: needs --precision bf16, --use-distributed-optimizer and transformer-engine on a GPU")

    def check(self) -> None:
        # torch's Adam and megatron-core's scheduler refuse these with a traceback (a negative clip: not at all)
        for name, value in (("--lr", self.lr), ("--min-lr", self.min_lr), ("--weight-decay", self.weight_decay),
                            ("--adam-eps", self.adam_eps), ("--clip-grad", self.clip_grad)):
            if value < 0:
                raise UsageError(f"{name} must be 0 or more, got {value}")
        for name, value in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            if not 0 <= value < 1:
                raise UsageError(f"{name} must lie in [0, 1), got {value}")
        if self.min_lr > self.lr:
            raise UsageError(f"--min-lr {self.min_lr} is above --lr {self.lr}")


@dataclass
class SchedulerOptions(Options):
    lr_decay_style: Literal["constant", "linear", "cosine", "WSD"] = option("constant", "learning-rate decay")
    lr_warmup_iters: int = option(0, "linear warmup length in iterations")
    lr_warmup_samples: int = option(0, "linear warmup length in samples")
    lr_decay_iters: int | None = option(None, "decay length in iterations (default: the whole run)")
    lr_decay_samples: int | None = option(None, "decay length in samples (default: the whole run)")
    lr_wsd_decay_iters: int | None = option(None, "WSD: iterations of the final decay phase")
    lr_wsd_decay_samples: int | None = option(None, "WSD: samples of the final decay phase")
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = option(
        "linear", "WSD: shape of the final decay phase")

    def check(self) -> None:
        if self.lr_warmup_iters and self.lr_warmup_samples:
            raise UsageError("give at most one of --lr-warmup-iters and --lr-warmup-samples")
        if self.lr_decay_iters is not None and self.lr_decay_samples is not None:
            raise UsageError("give at most one of --lr-decay-iters and --lr-decay-samples")
        if self.lr_decay_style == "WSD" and self.lr_wsd_decay_iters is None and self.lr_wsd_decay_samples is None:
            raise UsageError("--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples")
        for name, value in (("--lr-warmup-iters", self.lr_warmup_iters),
                            ("--lr-warmup-samples", self.lr_warmup_samples)):
            if value < 0:
                raise UsageError(f"{name} must be 0 or more, got {value}")
        at_least_one(("--lr-decay-iters", self.lr_decay_iters), ("--lr-decay-samples", self.lr_decay_samples),
                     ("--lr-wsd-decay-iters", self.lr_wsd_decay_iters),
                     ("--lr-wsd-decay-samples", self.lr_wsd_decay_samples))


@dataclass
class DataOptions(Options):
    data: Path | None = option(None, "an energon dataset directory or metadataset file (default: the provider's "
                                     "synthetic data)")
    num_workers: int = option(2, "data loader worker processes per data lane")
    prefetch_microbatches: int = option(
        2, "micro-batches a background thread prepares ahead, pinned on GPUs (a provider's own data, and --data's "
           "batching and packing after its loader workers); with --encoder-pass step at least a step's; 0: none")
    pack_sequences: bool = option(
        True, "pack several --data samples into each sequence (THD: positions restart and attention stays within a "
              "sample); a micro-batch then holds micro-batch-size packed sequences")
    packing_buffer_size: int | None = option(
        None, "--data samples read ahead per data lane to choose packs from (default: enough for four rows of "
              "seq_length at 128 tokens a sample, at least 64: more samples to choose from fill the rows fuller)")
    pack_image_tokens: int | None = option(
        None, "at most this many image tokens (placeholders) in one packed row: bounds the encoders' work and memory "
              "per row, which the memory plan counts (default: the most that fits the GPU, at most seq_length)")
    pack_scan_samples: int = option(
        0, "the memory plan reads this many of the first --data samples through the packer and counts the image "
           "tokens of the largest pack they make, a tighter plan (the run's packer then holds every row to it, and "
           "a later sample whose own images take more is skipped as too long); 0 (default): the most that fits")
    max_skip_fraction: float = option(
        0.1, "stop the run (exit 2, saving first with --save) when more than this share of the --data samples read "
             "were skipped (unreadable, unsupported or too long), checked once 100 have been read; 1: never")
    truncation_warning: float = option(
        0.05, "warn when seq_length cuts more than this share of the answer tokens read in a logging interval; 1: never")

    def check(self) -> None:
        if self.prefetch_microbatches < 0:
            raise UsageError(f"--prefetch-microbatches must be 0 or more, got {self.prefetch_microbatches}")
        if not 0 <= self.max_skip_fraction <= 1:
            raise UsageError(f"--max-skip-fraction must lie between 0 and 1, got {self.max_skip_fraction}")
        if not 0 <= self.truncation_warning <= 1:
            raise UsageError(f"--truncation-warning must lie between 0 and 1, got {self.truncation_warning}")
        for name, value in (("--packing-buffer-size", self.packing_buffer_size),
                            ("--pack-image-tokens", self.pack_image_tokens)):
            if value is not None and value < 1:
                raise UsageError(f"{name} must be 1 or more, got {value}")
        if self.pack_scan_samples < 0:
            raise UsageError(f"--pack-scan-samples must be 0 or more, got {self.pack_scan_samples}")
        if self.num_workers < 0:
            raise UsageError(f"--num-workers must be 0 or more, got {self.num_workers}")
        if self.data is not None and not self.data.exists():
            raise UsageError(f"--data {self.data}: no such file or directory")


@dataclass
class EvalOptions(Options):
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

    def check(self) -> None:
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
class LoggingOptions(Options):
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
    memory_snapshot_dir: Path | None = option(
        None, "GPU runs: record the allocator's history from start-up and write memory_rank<R>.pickle here after "
              "--memory-snapshot-iteration (scripts/memory_at_peak.py lists what was live at each rank's peak)")
    memory_snapshot_iteration: int = option(2, "the last iteration the memory snapshot records")
    profile_with_stack: bool = option(
        False, "record Python stacks in the profile: the summary names the source line that launched each of the "
               "busiest kernels (the profiled iterations' host side runs slower)")

    def check(self) -> None:
        at_least_one(("--log-interval", self.log_interval), ("--flop-check-iteration", self.flop_check_iteration))
        if self.max_nan_iters < 1:
            raise UsageError(f"--max-nan-iters must be at least 1, got {self.max_nan_iters}")
        if self.memory_snapshot_dir and self.memory_snapshot_iteration < 1:
            raise UsageError(f"--memory-snapshot-iteration must be at least 1, got {self.memory_snapshot_iteration}")
        if self.profile_dir and not 1 <= self.profile_step_start <= self.profile_step_end:
            raise UsageError(f"--profile-step-start {self.profile_step_start} and --profile-step-end "
                             f"{self.profile_step_end} must satisfy 1 <= start <= end")
        if self.profile_with_stack and not self.profile_dir:
            raise UsageError("--profile-with-stack records stacks in a profile: add --profile-dir DIR")


@dataclass
class LaunchOptions(Options):
    nproc_per_node: int = option(1, "worker processes to start on this node (under torchrun/srun: ignored)")
    nnodes: int = option(1, "nodes in the run; each starts mimo run with the same options")
    rdzv_endpoint: str | None = option(None, "host:port where the nodes meet (multi-node; default: this host)")
    rdzv_id: str = option("mimo", "run id shared by the nodes of one run")
    distributed_timeout_minutes: float = option(10.0, "a collective waiting longer (e.g. a rank died) fails the run")
    exit_signal: Literal["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"] = option(
        "SIGTERM", "on this signal (or SIGINT) every rank stops at the next iteration boundary, saves when --save is "
                   "set, and exits 1 (SLURM preempts with SIGTERM; sbatch --signal can send SIGUSR1 earlier)")

    def check(self) -> None:
        at_least_one(("--nproc-per-node", self.nproc_per_node), ("--nnodes", self.nnodes))
        if self.distributed_timeout_minutes <= 0:  # torch's rendezvous would time out at once, with a traceback
            raise UsageError(f"--distributed-timeout-minutes must be positive, got {self.distributed_timeout_minutes}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise UsageError("--nnodes > 1 needs --rdzv-endpoint host:port, the same on every node")
        if self.rdzv_endpoint:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise UsageError(f"--rdzv-endpoint {self.rdzv_endpoint} must be host:port (e.g. node0:29500), the "
                                 f"same on every node")


@dataclass
class CheckpointOptions(Options):
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
    keep_last: int | None = option(
        None, "keep only the newest N checkpoints of this run (never the one the tracker names, never another run's)")
    start_anew: bool = option(
        False, "start a new run in a --save folder that holds checkpoints this run does not --load: they stay where "
               "they are (never loaded, replaced or pruned) and this run's saves go beside them")

    def check(self) -> None:
        if self.pretrained and (self.pretrained_llm or self.pretrained_vision):
            raise UsageError("give --pretrained (a whole model) or its parts (--pretrained-llm, --pretrained-vision), "
                             "not both")
        at_least_one(("--save-interval", self.save_interval), ("--keep-last", self.keep_last))
        for option, value in (("--save-interval", self.save_interval), ("--keep-last", self.keep_last)):
            if value and not self.save:  # --keep-last was ignored silently
                raise UsageError(f"{option} needs --save DIR")
        if self.start_anew and not self.save:
            raise UsageError("--start-anew needs --save DIR (the folder whose checkpoints it keeps)")
        if self.finetune and not self.load:
            raise UsageError("--finetune needs --load DIR (the checkpoint whose weights to start from)")


@dataclass
class LayoutOptions(Options):
    """Which ranks run which module and how each module's ranks split; checked before any process group."""

    encoder_ranks: int = option(0, "ranks for the encoders, the LLM gets the rest (0: colocated on all ranks)")
    encoder_tp: int = option(1, "tensor parallelism of the encoders; colocated, the LLM's or one of their own (their "
                                "embeddings then change hands on the same ranks)")
    llm_tp: int = option(1, "tensor parallelism of the LLM")
    llm_pp: int = option(1, "pipeline parallelism of the LLM; with colocated encoders its stages run beside them, "
                            "the encoders once per step")
    llm_cp: int = option(
        1, "context parallelism of the LLM: each sample's merged sequence (text and encoder embeddings) is split "
           "over this many ranks, load-balanced (colocated layouts; the encoders stay CP 1)")
    llm_ep: int = option(1, "expert parallelism of the LLM")
    llm_expt_tp: int = option(1, "tensor parallelism of the LLM's experts")

    def check(self) -> None:
        at_least_one(("--encoder-tp", self.encoder_tp), ("--llm-tp", self.llm_tp), ("--llm-pp", self.llm_pp),
                     ("--llm-cp", self.llm_cp), ("--llm-ep", self.llm_ep), ("--llm-expt-tp", self.llm_expt_tp))
