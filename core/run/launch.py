"""Start this process's part of the run: pick the device, join (or create) the process group, seed."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from mimo.errors import UsageError
from mimo.wording import counted

from . import cpu_redirect, forked_workers

# Set in the workers mimo's own launcher starts: they have RANK like torchrun's, but their parent speaks for them.
LAUNCHED_BY_MIMO = "MIMO_LAUNCHED_WORKER"
# spawn: CPU workers start as fresh interpreters too (a library that cannot be forked; or to check the GPU path)
WORKER_START = "MIMO_WORKER_START"


def is_launched_worker() -> bool:
    """Whether this process is a worker mimo's own launcher started (its launcher prints the start-up lines)."""
    return bool(os.environ.get(LAUNCHED_BY_MIMO))


def die_with_launcher() -> None:
    """In a worker of mimo's launcher: get SIGTERM when the launcher dies, even by SIGKILL (workers run in sessions
    of their own, so nothing else would stop them): they then stop at the next boundary and save, or end themselves
    `lifeline.ORPHAN_GRACE_S` seconds later. The process takes its rank as its name ("mimo rank 1")."""
    launcher = os.environ.get(LAUNCHED_BY_MIMO)
    if not launcher or not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_NAME, PR_SET_PDEATHSIG = 15, 1
    libc = ctypes.CDLL(None, use_errno=True)
    # `ps -o comm`, top and /proc/PID/comm name the rank (a forked worker's environ there is its launcher's)
    libc.prctl(PR_SET_NAME, f"mimo rank {os.environ.get('RANK', '?')}".encode()[:15])
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(launcher):  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
    from .lifeline import ORPHAN_GRACE_S, watch_parent

    watch_parent(int(launcher), grace=ORPHAN_GRACE_S)  # the stop and save must not take forever


def external_world(launch_options) -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when a launcher started this process as one rank of the run: torchrun or
    mimo's own launcher (RANK, WORLD_SIZE), or an srun step whose tasks are the ranks. None when this process is
    to start the workers itself (or is the whole run)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and _in_srun_step():
        tasks = int(env["SLURM_NTASKS"])
        if launch_options.nproc_per_node > 1:  # each task is one node's launcher (one task per node)
            if tasks != launch_options.nnodes:
                raise UsageError(f"under srun with --nproc-per-node {launch_options.nproc_per_node}, each task "
                                 f"starts the workers of one node: --nnodes {launch_options.nnodes} must equal the "
                                 f"step's {counted(tasks, 'task')} (srun --ntasks-per-node 1)")
            return None
        if tasks > 1 and not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
            raise UsageError("under srun, set MASTER_ADDR and MASTER_PORT (e.g. the first host of "
                             "$SLURM_JOB_NODELIST and a free port) so the tasks can meet")
        return int(env["SLURM_PROCID"]), tasks, int(env.get("SLURM_LOCALID", 0))
    return None


def _in_srun_step() -> bool:
    # sbatch's batch script also has SLURM_PROCID (0); only srun's tasks have a step id.
    return "SLURM_STEP_ID" in os.environ or "SLURM_STEPID" in os.environ


def needs_launcher(launch_options) -> bool:
    """Whether this process starts the workers (torch's elastic launcher) instead of being a rank itself."""
    return (launch_options.nproc_per_node > 1 or launch_options.nnodes > 1) and external_world(launch_options) is None


def world_size(launch_options) -> int:
    external = external_world(launch_options)
    return external[1] if external else launch_options.nnodes * launch_options.nproc_per_node


def speaks_for_run(launch_options) -> bool:
    """Whether this process says the run's start-up lines and holds its save lock: exactly one process per run
    (on several nodes under mimo's launcher, global rank 0, as a node's launcher does not know its node rank)."""
    external = external_world(launch_options)
    if external is None:
        return launch_options.nnodes == 1
    if os.environ.get(LAUNCHED_BY_MIMO):
        return external[0] == 0 and launch_options.nnodes > 1
    return external[0] == 0


def check_rendezvous_host(endpoint: str | None) -> None:
    """A host name this machine cannot resolve would keep the rendezvous retrying until its timeout."""
    if not endpoint:
        return
    host, _, port = endpoint.rpartition(":")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port))
    except (socket.gaierror, UnicodeError) as err:
        raise UsageError(f"--rdzv-endpoint {endpoint}: host '{host}' is not known here ({err}): give the first "
                         f"node's name or address") from None


def resolve_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no GPU is visible to this process; use --device cpu or auto")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        local = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0))
        return torch.device("cuda", int(local))
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
        elif "SLURM_PROCID" in os.environ and os.environ.get("MASTER_ADDR") and _in_srun_step():
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


def limit_device_connections(layout) -> None:
    """With tensor or context parallelism, one hardware queue per GPU (CUDA_DEVICE_MAX_CONNECTIONS=1), so that
    the GPU runs a layer's communication kernels in the order they were launched and overlaps them with compute
    as megatron-core schedules it (Megatron-Bridge's rule for Hopper). Before CUDA starts; a value set wins."""
    if layout.one_hardware_queue():
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def seed_everything(seed: int, tp_rank: int, ep_rank: int, etp_rank: int, te_rng_tracker: bool = False) -> None:
    """Seed torch and megatron-core's model-parallel RNG tracker (explicit ranks: no parallel_state)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, te_rng_tracker=te_rng_tracker, tp_rank=tp_rank, ep_rank=ep_rank,
                                    etp_rank=etp_rank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(options, argv: list[str], device: str = "auto", preload: list[str] = ()) -> int:
    """Start `options.nproc_per_node` copies of `mimo ARGV` on this node with torch's elastic launcher.

    The workers join one world (nodes meet at `rdzv_endpoint`); if any worker fails, the launcher stops the
    others. On CPU they are forked from this process once it has imported `preload` (forked_workers.py); on
    GPUs they are fresh interpreters. Returns the exit code for the parent: 0, or 1 after printing which rank failed.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Workers on one node share its cores; without a limit each would start a thread per core (torchrun does this).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // options.nproc_per_node)))
    os.environ[LAUNCHED_BY_MIMO] = str(os.getpid())  # the workers inherit it: their launcher's pid
    start = os.environ.get(WORKER_START, "fork")
    if start not in ("fork", "spawn"):
        raise UsageError(f"{WORKER_START}={start}: choose fork (CPU workers forked from the launcher, the default) "
                         f"or spawn (fresh interpreters, as on GPUs)")
    forked = start == "fork" and resolve_device(device).type == "cpu"
    config = LaunchConfig(
        min_nodes=options.nnodes, max_nodes=options.nnodes, nproc_per_node=options.nproc_per_node,
        run_id=options.rdzv_id, rdzv_backend="c10d", rdzv_endpoint=options.rdzv_endpoint or "localhost:0",
        max_restarts=0, monitor_interval=0.5, start_method="fork" if forked else "spawn",
    )
    # The agent's warnings narrate a normal stop ("Sending process ... closing signal SIGTERM"); its errors stay,
    # but for the report of a failed worker, which mimo says in one line below (forked, with a traceback).
    # torch gives each of its modules' loggers a level of its own, so each is set.
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        if forked:
            forked_workers.import_modules(list(preload))
            elastic_launch(config, forked_workers.run_worker)(*argv)
        else:
            elastic_launch(config, sys.executable)("-m", "mimo.cli", *argv)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        print(f"error: worker rank {rank} failed first (exit code {failure.exitcode}); the launcher stopped the "
              f"others (see its output above)", file=sys.stderr, flush=True)
        return 1
    except SignalException:  # the launcher passed the signal on to the workers and waited: they said how it ended
        return 1
    return 0
