"""Stopping on a signal (a SLURM preemption's SIGTERM, a Ctrl-C): the handler only notes the signal; every rank
learns of it at the next iteration boundary (one collective), saves when `--save` is set, and stops together
(stop.py), so no rank waits forever in a collective the others left and no work since the last save is lost."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


class SignalWatch:
    """Notes `--exit-signal` and SIGINT while installed; `agreed()` is collective over the world."""

    def __init__(self, exit_signal: str = "SIGTERM"):
        self.watched = {getattr(signal, exit_signal), signal.SIGINT}
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self):
        for number in self.watched:
            self._previous[number] = signal.signal(number, self._note)
        return self

    def __exit__(self, *exc):
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _note(self, number, frame):
        if self.received is not None and number == signal.SIGINT:  # a second Ctrl-C: the user means now
            raise KeyboardInterrupt
        self.received = number

    def agreed(self, device: torch.device) -> int | None:
        """The signal any rank received (every rank calls this at the same boundary), or None. Alone in the world
        there is nothing to agree on: no collective, so the host does not wait for the step's update."""
        if dist.get_world_size() == 1:
            return self.received or None
        flag = torch.tensor([self.received or 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None
