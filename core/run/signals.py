"""Stopping on a signal (a SLURM preemption's SIGTERM, a Ctrl-C): the handler only notes the signal; every rank
learns of it at the next iteration boundary (one collective), saves when `--save` is set, and stops together
(stop.py), so no rank waits forever in a collective the others left and no work since the last save is lost.

A second Ctrl-C means "now", except while a checkpoint is being written (`SignalWatch.saving`): cut short there,
megatron-core's writer fails with a traceback and ERROR lines and leaves a half-written iter_*. So it says, in one
line, that the save is finishing; the run stops once it is written, at that boundary."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import torch
import torch.distributed as dist

SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


class SignalWatch:
    """Notes `--exit-signal` and SIGINT while installed; `agreed()` is collective over the world."""

    def __init__(self, exit_signal: str = "SIGTERM"):
        self.watched = {getattr(signal, exit_signal), signal.SIGINT}
        self.received: int | None = None
        self._previous: dict = {}
        self.saving_what: str | None = None  # the checkpoint being written, e.g. "iteration 3 in SAVE"
        self._told = False  # the save-in-progress line was printed for this save
        self._pid = os.getpid()

    def __enter__(self):
        for number in self.watched:
            self._previous[number] = signal.signal(number, self._note)
        return self

    def __exit__(self, *exc):
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    @contextlib.contextmanager
    def saving(self, what: str):
        """While a checkpoint (`what`) is being written, a second Ctrl-C does not cut it short."""
        self.saving_what, self._told = what, False
        try:
            yield
        finally:
            self.saving_what = None

    def _note(self, number, frame):
        if os.getpid() != self._pid:  # a forked helper (a background save's writer): the run itself decides
            return
        if self.received is not None and number == signal.SIGINT:
            if self.saving_what is None:
                raise KeyboardInterrupt  # a second Ctrl-C: the user means now
            if not self._told and _speaks():
                print(f"stopping once the checkpoint of {self.saving_what} is written (a save cut short would be "
                      f"left half-written)", file=sys.stderr, flush=True)
            self._told = True
            return
        self.received = number

    def agreed(self, device: torch.device) -> int | None:
        """The signal any rank received (every rank calls this at the same boundary), or None. Alone in the world
        there is nothing to agree on: no collective, so the host does not wait for the step's update."""
        if dist.get_world_size() == 1:
            return self.received or None
        flag = torch.tensor([self.received or 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None


def saving(watch: SignalWatch | None, what: str):
    """`watch.saving(what)`, or nothing when no watch is installed (a session driven without `train`)."""
    return watch.saving(what) if watch is not None else contextlib.nullcontext()


def _speaks() -> bool:
    """Rank 0 says it (a terminal's Ctrl-C reaches every rank of the machine)."""
    return not dist.is_initialized() or dist.get_rank() == 0
