"""Every stop mimo decides, at an iteration boundary, on every rank at once, saving first.

The inputs are world-agreed already: a signal through its collective (signals.py), a data error, the skip counts
and the NaN state through the step's all-reduced totals. So every rank takes the same branch, and no rank waits in
a collective the others left. With `--save`, the run saves the iteration it stopped at (unless that one is saved
already), waits for background saves, and names the iteration in its one line:

    stopped by SIGTERM after iteration 7; saved iteration 7 in SAVE (resume with --load SAVE)

A data error arrives in the middle of an iteration (the lane loader hands out empty micro-batches for the rest of
it and the step makes no update), so the save is of the iteration before, with the loader state of that boundary.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimo.errors import TrainingStopped, UsageError

from ..telemetry.skip_report import skip_stop_message
from .signals import saving

__all__ = ["DataStopped", "Interrupted", "Stop", "decide", "stop_run"]


class Interrupted(TrainingStopped):
    """A stop on a signal or the NaN limit (exit 1); `quiet` on every rank but the one that says it."""

    def __init__(self, message: str, quiet: bool):
        super().__init__(message)
        self.quiet = quiet


class DataStopped(UsageError):
    """A stop for the data (the skip guard, a data error: exit 2); `quiet` on every rank but the one that says it."""

    def __init__(self, message: str, quiet: bool):
        super().__init__(message)
        self.quiet = quiet


@dataclass
class Stop:
    message: str  # what stopped the run (the save is added to it)
    exit_code: int  # 1: a signal or the NaN limit; 2: the data
    saves: int  # the iteration whose state is current: the one just trained, or the one before a data error


def decide(session, result, signal_number: int | None) -> Stop | None:
    """The first reason to stop after this iteration: a signal, a data error, the NaN limit, the skip guard."""
    s, data = session, session.plan.config.data
    if signal_number:
        return Stop(f"stopped by {signal.Signals(signal_number).name} after iteration {s.iteration}", 1,
                    s.iteration)
    if result.data is not None and result.data.data_error:
        return Stop(_data_error_message(s), 2, s.iteration - 1)
    if s.logger.nan_stop:
        return Stop(s.logger.nan_stop, 1, s.iteration)
    if data.data is not None and result.data is not None:
        message = skip_stop_message(result.data, data.max_skip_fraction, data.data,
                                    getattr(s.plan.settings, "seq_length", None))
        if message:
            return Stop(message, 2, s.iteration)
    return None


def _data_error_message(s) -> str:
    """The data error's own line, from the lowest rank that met it (all ranks agree on which)."""
    error = s.source.data_error
    world = dist.get_world_size()
    first = torch.tensor([dist.get_rank() if error else world], dtype=torch.int64, device=s.device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    s.data_error_rank = int(first.item())
    return error or "the data failed on another rank"


def stop_run(session, stop: Stop, first_iteration: int) -> None:
    """Save (when --save is set and the state is not saved yet), let saves land, leave the world, raise."""
    s, c = session, session.plan.config.checkpoint
    saved = "; nothing saved (no --save)"
    if s.checkpointer is not None and c.save:
        with saving(s.signal_watch, f"iteration {stop.saves} in {c.save}"):
            if stop.saves <= first_iteration:
                saved = f"; nothing saved (nothing trained since iteration {first_iteration})"
            else:
                done = True
                if not is_scheduled_save(s, stop.saves):  # else the loop saved it (this iteration or the one before)
                    consumed = s.consumed - (s.iteration - stop.saves) * s.plan.global_batch_size
                    done = s.checkpointer.save(stop.saves, consumed)
                saved = (f"; saved iteration {stop.saves} in {c.save} (resume with --load {c.save})" if done else
                         f"; iteration {stop.saves} not saved (its folder in {c.save} holds another run's checkpoint)")
            s.checkpointer.wait(blocking=True)
    s.logger.close()
    s.skips.close()
    s.source.close()
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    speaker = getattr(s, "data_error_rank", 0) if stop.exit_code == 2 else 0
    raise (DataStopped if stop.exit_code == 2 else Interrupted)(stop.message + saved, quiet=rank != speaker)


def is_scheduled_save(s, iteration: int) -> bool:
    """Whether the loop saves `iteration` anyway (the last one, or an interval's)."""
    c = s.plan.config.checkpoint
    return iteration == s.plan.train_iters or bool(c.save_interval and iteration % c.save_interval == 0)
