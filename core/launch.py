"""Start this process's part of the run: pick the device, join (or create) the process group, seed."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from mimo.errors import UsageError

from . import cpu_redirect


def resolve_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no GPU is visible to this process; use --device cpu or auto")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_process(requested_device: str, timeout_minutes: float = 10.0) -> torch.device:
    """Set up the device and torch.distributed: join a launcher's world (torchrun, srun) or make a world of one."""
    device = resolve_device(requested_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        cpu_redirect.enable()
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(minutes=timeout_minutes)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        elif "SLURM_PROCID" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout, rank=int(os.environ["SLURM_PROCID"]),
                                    world_size=int(os.environ["SLURM_NTASKS"]))
        else:
            dist.init_process_group(backend, timeout=timeout, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1)
    # megatron-core's local attention takes scratch tensors from this buffer; it holds memory, no process group.
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    return device


def seed_everything(seed: int, tp_rank: int, ep_rank: int, etp_rank: int) -> None:
    """Seed torch and megatron-core's model-parallel RNG tracker (explicit ranks: no parallel_state)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(options, argv: list[str]) -> int:
    """Start `options.nproc_per_node` copies of `mimo ARGV` on this node with torch's elastic launcher.

    The workers join one world (nodes meet at `rdzv_endpoint`); if any worker fails, the launcher stops the
    others. Returns the exit code for the parent: 0, or 1 after printing which rank failed.
    """
    import sys

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Workers on one node share its cores; without a limit each would start a thread per core (torchrun does this).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // options.nproc_per_node)))
    config = LaunchConfig(
        min_nodes=options.nnodes, max_nodes=options.nnodes, nproc_per_node=options.nproc_per_node,
        run_id=options.rdzv_id, rdzv_backend="c10d", rdzv_endpoint=options.rdzv_endpoint or "localhost:0",
        max_restarts=0, monitor_interval=0.5, start_method="spawn",
    )
    try:
        elastic_launch(config, sys.executable)("-m", "mimo.cli", *argv)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        print(f"error: worker rank {rank} failed first (exit code {failure.exitcode}); the launcher stopped the "
              f"others (see its output above)", file=sys.stderr, flush=True)
        return 1
    return 0
