"""The training loop: start the session (session.py), then step, log, evaluate and save until the last
iteration or a stop (stop.py: a signal, a data error, the NaN limit, the skip guard; saving first), and leave
the world. The path of a run: config -> plan (plan.py) -> start-up checks
(preflight.py) -> workers (launch.py) -> world (world.py) -> session -> loop -> step (step.py)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mimo.errors import TrainingStopped, UsageError
from mimo.plugins import Registry

from ..config import RunConfig
from ..memory.fit import out_of_memory
from ..telemetry.summary import summary_lines
from . import signals
from .garbage import GarbageCollection
from .plan import Plan, prepare
from .session import Session, start
from .stop import decide, is_scheduled_save, stop_run


def advance(session: Session, iterations: int, first_iteration: int | None = None,
            garbage: GarbageCollection | None = None) -> None:
    """Train `iterations` more iterations (at most to the end of the run): step, log, evaluate, decide, save;
    `garbage` collects at its interval."""
    garbage = garbage or GarbageCollection(0)
    plan, s = session.plan, session
    c, flop_check = plan.config.checkpoint, plan.config.logging.flop_check_iteration
    first_iteration = s.iteration if first_iteration is None else first_iteration
    boundary = s.source.mark_boundary if c.save else None
    for iteration in range(s.iteration + 1, min(s.iteration + iterations, plan.train_iters) + 1):
        s.profiler.before(iteration)
        if s.compiles:
            s.compiles.before(iteration)
        started = time.perf_counter()
        try:
            if iteration == flop_check:
                result = _counted_step(s.step, s.data, s.logger, s.device)
            else:
                result = s.step(s.data)
        except torch.OutOfMemoryError:  # one line, not a traceback from inside the model
            raise TrainingStopped(out_of_memory(plan, iteration, s.device)) from None
        if s.compiles:
            s.compiles.after(iteration, time.perf_counter() - started)
        s.profiler.after(iteration)
        if s.memory:
            s.memory.after(iteration)
        s.iteration, s.consumed = iteration, s.consumed + plan.global_batch_size
        s.skips.report()
        s.logger.update(iteration, result, s.consumed)
        data_error = result.data is not None and result.data.data_error
        if s.evaluations and not data_error:  # after a data error the weights are those of the iteration before
            s.evaluations.after_iteration(iteration, result.data.samples if result.data is not None else s.consumed)
        received = s.signal_watch.agreed(s.device) if s.signal_watch is not None else None
        stop = decide(s, result, received)
        if s.checkpointer and c.save:
            with signals.saving(s.signal_watch, f"iteration {iteration} in {c.save}"):
                s.checkpointer.wait(blocking=False)
                if is_scheduled_save(s, iteration) and not data_error:
                    s.checkpointer.save(iteration, s.consumed)
                    if stop is None and s.signal_watch is not None:  # a Ctrl-C during the save: stop here, saved
                        stop = decide(s, result, s.signal_watch.agreed(s.device))
            if boundary is not None and not data_error:
                boundary()  # the loader's state at this boundary: what a save after a data error writes
        if stop is not None:
            stop_run(s, stop, first_iteration)
        garbage.after(iteration)


def finish(session: Session) -> list[dict]:
    """Close the logs, let background saves land, leave the world. Returns the logged records (logging rank)."""
    session.logger.close()
    session.skips.close()
    if session.compiles:
        session.compiles.close()
    if session.checkpointer:
        with signals.saving(session.signal_watch, f"iteration {session.iteration}"):
            session.checkpointer.wait(blocking=True)
    session.source.close()  # a read-ahead thread, or a loader's worker processes
    dist.barrier()
    # Tear the groups down while every rank is still here: gloo's threads abort a process that exits with them.
    dist.destroy_process_group()
    return session.logger.records if session.logger.enabled else []


def train(plan: Plan) -> list[dict]:
    """Run the plan in this process (one rank of the world). Returns the logged records on the logging rank."""
    started = time.perf_counter()
    with signals.SignalWatch(plan.config.launch.exit_signal) as watch:
        session = start(plan)
        session.signal_watch = watch
        first_iteration = session.iteration
        if first_iteration >= plan.train_iters:  # loaded (so checked) and at its end already
            if session.logger.enabled:
                print(f"nothing to train: the checkpoint in {plan.config.checkpoint.load} is at iteration "
                      f"{first_iteration} and this run ends at iteration {plan.train_iters}; raise --train-iters "
                      f"to train further", flush=True)
            return finish(session)
        garbage = GarbageCollection(plan.config.performance.gc_interval)
        garbage.start()
        try:
            if session.evaluations:
                counted = session.step.data_start  # samples (not packed rows) where the data counts them
                seen = counted.samples if counted is not None else session.consumed
                session.evaluations.at_start(session.iteration, seen)
            advance(session, plan.train_iters - session.iteration, first_iteration, garbage)
        except BaseException:
            session.logger.close()
            session.skips.close()
            if session.compiles:
                session.compiles.close()
            raise
        finally:
            garbage.stop()
        records = finish(session)
        if session.logger.enabled:
            print("\n".join(summary_lines(session, first_iteration, time.perf_counter() - started)), flush=True)
        return records


def _counted_step(step, data, logger, device):
    """One step under torch's FLOP counter (forward and backward, every rank's share summed), compared with the
    provider's model_flops figure the logs use for TFLOP/s and MFU."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as counter:
            result = step(data)
    except Exception as err:  # noqa: BLE001 - torch's counter rejects some operator uses (e.g. SDPA with GQA)
        raise UsageError(f"--flop-check-iteration: torch's FLOP counter failed on this model "
                         f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); run without "
                         f"--flop-check-iteration") from None
    counted = torch.tensor([float(counter.get_total_flops())], dtype=torch.float64, device=device)
    dist.all_reduce(counted)
    if logger.enabled:
        reported = logger.flops_per_iteration
        ratio = f"{reported / counted.item():.3f}" if reported and counted.item() else "n/a"
        print(f"FLOP check: torch's counter {counted.item():.4e} FLOPs this iteration, model_flops x 3 "
              f"{reported or 0:.4e} (ratio {ratio})", flush=True)
    return result


def run(config: RunConfig, registry: Registry | None = None) -> list[dict]:
    return train(prepare(config, registry))
