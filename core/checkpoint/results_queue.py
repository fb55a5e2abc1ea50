"""Where megatron-core's checkpoint writers hand back their results, without a process of its own.

megatron-core 0.19.2 (`dist_checkpointing/strategies/filesystem_async.get_write_results_queue`) makes, at the first
save, a spawn-context `multiprocessing.Manager().Queue()`: a server process (which re-imports mimo, about 0.6 GB)
and the resource tracker. Neither watches its parent: after a SIGKILL of the run they live on under PID 1. This
queue takes its place (installed through the module's `_results_queue`, which megatron-core reads first):

* in the process that saves, `put` and `get_nowait` use a deque (a sync save's writer threads put, the same
  process reads right after);
* in a forked child (megatron-core's async writer), `put` goes through a fork-context pipe queue (no server, no
  resource tracker), which the child flushes before it exits and the parent reads when it finalizes the save.

It relies on megatron-core's private global; `tests/multiprocess/test_orphans.py` fails loudly if a save starts a
process again (e.g. after an upgrade).
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import queue

__all__ = ["ResultsQueue", "install"]

_WAIT_S = 30  # for an async writer's results, once megatron-core has joined the writer


class ResultsQueue:
    def __init__(self):
        self._owner = os.getpid()
        self._local: collections.deque = collections.deque()
        self._pipe = multiprocessing.get_context("fork").Queue()

    def put(self, item, *args, **kwargs) -> None:
        if os.getpid() == self._owner:
            self._local.append(item)
        else:
            self._pipe.put(item)

    def get_nowait(self):
        if self._local:
            return self._local.popleft()
        try:
            return self._pipe.get(timeout=_WAIT_S)
        except queue.Empty:
            raise queue.Empty from None

    def get(self, *args, **kwargs):
        return self.get_nowait()


def install() -> None:
    """Make megatron-core's checkpoint writers report through a ResultsQueue (once per process)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, ResultsQueue):
        filesystem_async._results_queue = ResultsQueue()
