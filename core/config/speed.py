"""The options of the loop's components that say how GPU time and memory are spent: recomputation, overlapped
communication, FP8, CUDA graphs (`performance`), the memory budget (`memory`), and what is compiled and kept
(`compile`). Each validates its own fields (`Options.validate`); what needs the optimizer's or the training's options
is RunConfig.validate's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mimo.errors import UsageError

from .option import Options, option

RECOMPUTE_MODES = ("none", "selective", "full")
CUDA_GRAPH_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")  # megatron's CudaGraphModule


@dataclass
class PerformanceOptions(Options):
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

    def check(self) -> None:
        self.recompute_modes()
        if self.gc_interval < 0:
            raise UsageError(f"--gc-interval must be 0 (automatic collection) or a number of iterations, got "
                             f"{self.gc_interval}")
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
class MemoryOptions(Options):
    gpu_memory: float | None = option(
        None, "GiB of memory per GPU the run may use: a layout whose estimate does not fit is refused before "
              "start (default: the visible GPU's, else 80)")
    image_patches: str = option(
        "max", "image tokens per sample the memory estimate assumes for the encoders of unpacked rows: max (every "
               "image of a sample at its largest, the default), mean (the provider's average image), or a number; "
               "packed --data rows are counted at --pack-image-tokens instead")

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

    def check(self) -> None:
        if self.gpu_memory is not None and not self.gpu_memory > 0:
            raise UsageError(f"--gpu-memory must be a positive number of GiB, got {self.gpu_memory}")
        self.encoder_tokens()


@dataclass
class CompileOptions(Options):
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

    def check(self) -> None:
        kc = self.kernel_configs
        if kc is not None and kc != "none" and not Path(kc).is_file():
            raise UsageError(f"--kernel-configs {kc}: no such file (a table mimo wrote, or none)")
