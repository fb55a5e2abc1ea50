"""Reading micro-batches ahead in a background thread, so making them (e.g. a provider's synthetic images) overlaps
with the GPU's work instead of leaving it idle at the start of every micro-batch.

On an H100, mock-vlm's synthetic data left the GPU idle for about 85 ms of a 1.2 s iteration before this (see
docs/benchmarks.md). torch's CPU kernels release the GIL, so the thread works alongside the loop's kernel launches.
On CUDA the thread also pins the batch's tensors, which makes the loop's host-to-device copies asynchronous.

Only sources without a state of their own are read ahead: a resumable one (`DataSource.resumable`: energon's lane
loader, with its own worker processes) would be saved ahead of what training consumed. The read-ahead is itself a
DataSource with the defaults (no state, no counts: the loop takes those from the source), whose `close` stops the
thread; the thread closes the source.
"""

from __future__ import annotations

import queue
import threading

import torch

from mimo.data.read_ahead import pinned
from mimo.plugins import DataSource
from mimo.plugins.data_source import as_data_source

_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher(DataSource):
    """Iterates `source` (a DataSource, or a plain iterator) up to `depth` items ahead in a daemon thread; errors
    surface at the matching `next`."""

    def __init__(self, source, depth: int, pin_memory: bool = False):
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._pin = pin_memory
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(as_data_source(source),), name="mimo-prefetch",
                                        daemon=True)
        self._thread.start()

    def _fill(self, source: DataSource) -> None:
        try:
            for item in source:
                self._queue.put(pinned(item) if self._pin else item)
                if self._stop.is_set():
                    return
            self._queue.put(_END)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, which raises it
            self._queue.put(_Failure(err))
        finally:
            source.close()  # the thread that runs a generator is the one that may close it

    def close(self) -> None:
        """Stop reading: the thread ends after the item it is making (emptying the queue frees a blocked put)."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def __next__(self):
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)  # every later call ends too
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.error
        return item


def read_ahead(source: DataSource, depth: int, device: torch.device) -> DataSource:
    """`source` read ahead by `depth` items (pinned on CUDA), or itself when it is resumable or `depth` is 0."""
    if depth <= 0 or source.resumable:
        return source
    return Prefetcher(source, depth, pin_memory=device.type == "cuda")
