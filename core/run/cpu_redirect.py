"""Run megatron-core's CUDA-only code paths on the CPU.

megatron-core hard-codes CUDA in places that have no flag (DDP grad buffers, the optimizers, the schedules,
dist_checkpointing's save, the bridge communicators, a few model constructors). On a CPU run this module
redirects those calls: CUDA device arguments become the CPU, `torch.cuda.synchronize`/streams/events become
no-ops, the CUDA RNG state is the CPU generator's, and NCCL process groups become gloo. It is enabled only by
`enable()` from `launch` when the run's device is the CPU (on a GPU host too: CUDA then reads as absent), and
never on a GPU run.

Limits (see docs/cpu.md): CUDA-only kernels (transformer-engine, mamba-ssm, fused kernels) stay unavailable;
memory figures read 0; the redirect is per process and applies to the thread that enabled it and to torch
functions called from any thread through the patched `torch.cuda` functions.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_enabled = False


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal (e.g. `torch.cuda.current_device()`); bools are not devices.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):  # pinning needs the driver (CP's rotary split pins its chunk indices)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func in (torch.Tensor.pin_memory, torch.Tensor.record_stream):
            return args[0] if func is torch.Tensor.pin_memory else None
        if func is dist.all_to_all_single:
            # megatron-core's MoE dispatcher moves its split sizes to the host (as lists) only from a GPU
            args = tuple(a.tolist() if i in (2, 3) and torch.is_tensor(a) else a for i, a in enumerate(args))
            kwargs = {k: v.tolist() if k.endswith("split_sizes") and torch.is_tensor(v) else v
                      for k, v in kwargs.items()}
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and not result.startswith("torch.cuda."):
            # The optimizers accept only parameters whose type names say CUDA.
            return "torch.cuda." + result.removeprefix("torch.")
        return result


class _NullStream:
    """Stands in for torch.cuda.Stream/Event: every operation completes at once on the CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        # record_event(), wait_stream(), ...: return a finished stand-in so chained calls (.synchronize()) work
        return lambda *args, **kwargs: _NullStream()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _cpu_rng_state(*args, **kwargs):
    return torch.get_rng_state()


def _set_cpu_rng_state(state, *args, **kwargs):
    torch.set_rng_state(state.cpu() if state.device.type != "cpu" else state)


def _gloo_instead_of_nccl(make_group):
    def wrapped(*args, **kwargs):
        if "nccl" in str(kwargs.get("backend")):
            kwargs["backend"] = "gloo"
            kwargs.pop("pg_options", None)
        return make_group(*args, **kwargs)

    return wrapped


def enable() -> None:
    """Redirect CUDA to the CPU for the rest of this process. Idempotent."""
    global _enabled
    if _enabled:
        return
    _enabled = True
    _CudaToCpu().__enter__()  # stays pushed for the life of the process
    # Here the "GPU" RNG is the CPU generator, so every dropout inside megatron-core's RNG tracker changes the CPU
    # state and megatron-core logs a warning per layer and step: true by construction, and nothing to act on.
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage())

    cuda = torch.cuda
    cuda.is_available = lambda: False  # a CPU run on a GPU host: nothing may take the GPU path
    cuda.current_device = lambda: 0
    cuda.set_device = lambda *a, **k: None
    cuda.device_count = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    cuda.Stream = _NullStream
    cuda.Event = _NullStream
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.get_rng_state = _cpu_rng_state
    cuda.set_rng_state = _set_cpu_rng_state
    # torch.manual_seed calls torch.cuda.manual_seed_all, so these must not call back into it.
    cuda.manual_seed = cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    # The bridge communicators ask for NCCL groups by name.
    dist.new_group = _gloo_instead_of_nccl(dist.new_group)
    dist.new_subgroups_by_enumeration = _gloo_instead_of_nccl(dist.new_subgroups_by_enumeration)

    # megatron-core reads and writes the CUDA generator through its own helpers.
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state
    # Autograd runs backward on a thread where this redirection mode is not active; these backwards make tensors
    # on `torch.cuda.current_device()`: recomputation (--recompute runs forward code again) and the MoE dispatcher's
    # all-to-all (expert parallelism).
    from megatron.core.tensor_parallel import mappings

    for function in (mcore_random.CheckpointFunction, mappings._AllToAll):
        _redirect_backward(function)


def _redirect_backward(function) -> None:
    backward = function.backward

    def redirected_backward(ctx, *grads):
        with _CudaToCpu():
            return backward(ctx, *grads)

    function.backward = staticmethod(redirected_backward)


def is_enabled() -> bool:
    return _enabled
