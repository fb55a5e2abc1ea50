"""Where a step's time goes, per module: data loading, forward, backward, waiting on the bridge, optimizer.

Each rank times its own phases (on a GPU, with a synchronize at each boundary, so timing costs a little and is
opt-in: `--log-timers`). In a heterogeneous layout a rank holds one module, so its phases are that module's;
colocated ranks report under every module they hold. Once per log interval the ranks combine their figures
(the maximum over the ranks of a module) so the logging rank can print them.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch.profiler import record_function

PHASES = ("data", "forward", "backward", "bridge", "optimizer")
_BRIDGE_METHODS = ("send_forward", "recv_forward", "send_backward", "recv_backward", "send_forward_recv_backward",
                   "send_backward_recv_forward")


class StepTimers:
    def __init__(self, enabled: bool, *, modules: list[str], held: list[str], device: torch.device):
        """`enabled` (--log-timers): time with a synchronize at each phase boundary; else only label phases.
        `modules`: every module of the run; `held`: those this rank holds."""
        self.modules, self.held, self.device, self.enabled = modules, held, device, enabled
        self.totals = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str):
        with record_function(f"mimo/{name}"):  # labels the phase in profiler traces (--profile-dir)
            if not self.enabled:
                yield
                return
            self._sync()
            start = time.perf_counter()
            try:
                yield
            finally:
                self._sync()
                self.totals[name] += time.perf_counter() - start

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, name: str, function):
        def wrapper(*args, **kwargs):
            with self.phase(name):
                return function(*args, **kwargs)

        return wrapper

    def watch_bridge(self, communicator) -> None:
        """Time every send/receive of the bridge communicator (this rank's waits on the other grid)."""
        if self.enabled:
            for method in _BRIDGE_METHODS:
                if hasattr(communicator, method):
                    setattr(communicator, method, self.timed("bridge", getattr(communicator, method)))

    @contextlib.contextmanager
    def backward_of(self, schedules_module):
        """Time (and label) megatron-core's backward steps while its schedule runs (looked up by module name)."""
        names = ("backward_step", "backward_step_multimodule")
        originals = {n: getattr(schedules_module, n) for n in names}
        try:
            for name, function in originals.items():
                setattr(schedules_module, name, self.timed("backward", function))
            yield
        finally:
            for name, function in originals.items():
                setattr(schedules_module, name, function)

    def collect(self, iterations: int) -> dict[str, dict[str, float]] | None:
        """Milliseconds per iteration for each module and phase, maximum over ranks (collective); resets."""
        if not self.enabled:
            return None
        table = torch.zeros(len(self.modules), len(PHASES), dtype=torch.float64, device=self.device)
        for name in self.held:
            table[self.modules.index(name)] = torch.tensor([self.totals[p] for p in PHASES], dtype=torch.float64)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
        self.totals = dict.fromkeys(PHASES, 0.0)
        per_iteration = (table * 1000 / max(iterations, 1)).tolist()
        return {m: dict(zip(PHASES, row)) for m, row in zip(self.modules, per_iteration)}


def format_timers(timers: dict[str, dict[str, float]]) -> str:
    modules = " || ".join(f"{m}: " + " ".join(f"{p} {ms:.1f}" for p, ms in phases.items() if ms > 0)
                          for m, phases in timers.items())
    return f"time per iteration, ms (max over ranks): {modules}"
