"""The lane loader's read-ahead: micro-batches made in a thread while the GPU trains on earlier ones.

Making a micro-batch in the training thread (taking the workers' samples, `task_encoder.batch`: tensors built and
~100 MB of image pixels concatenated, then a copy to the GPU from unpinned memory) left the GPU idle for about a
third of a mid iteration on real-shaped data. Here a thread makes `depth` micro-batches ahead and pins them (their
copies to the GPU then run asynchronously); torch's kernels release the GIL, so it works beside the loop.

What the loop reads of the loader (its data counts, a held data error, the state a checkpoint saves) must be as of
the micro-batches it consumed, not those made ahead: each micro-batch travels with a `Made` record of the loader's
view after making it (lane_stream.py `StreamView`: small copies, not the samples), and the loader answers from the
record of the last micro-batch consumed (lane_loader.py).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["Made", "MadeAhead", "pinned"]


@dataclass
class Made:
    """A micro-batch and the loader's view right after making it."""

    batch: Any
    views: list  # one StreamView per stream
    micro_batches: int
    data_error: str | None
    rows: list = field(default_factory=list)  # (lane, global worker, index, key) per row
    records: list = field(default_factory=list)  # the skips counted while making it (SkipRecord)


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class MadeAhead:
    """Calls `make()` in a daemon thread, `depth` results ahead; `lock` is held while it makes one (the loader
    takes it to read energon's state between two). Errors surface at the matching `next`."""

    def __init__(self, make: Callable[[], Made], depth: int, lock: threading.Lock, pin_memory: bool):
        self._make, self._lock, self._pin = make, lock, pin_memory
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="mimo-lane-loader", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    if self._stop.is_set():
                        return
                    made = self._make()
                if self._pin:
                    made.batch = pinned(made.batch)
            except BaseException as err:  # noqa: BLE001 - handed to the consumer, which raises it
                self._queue.put(_Failure(err))
                return
            self._queue.put(made)

    def next(self) -> Made:
        item = self._queue.get()
        if isinstance(item, _Failure):
            self._queue.put(item)  # every later call fails the same way
            raise item.error
        return item

    def close(self, timeout: float = 60.0) -> None:
        """Stop making: the thread ends after the micro-batch it is making (emptying the queue frees a blocked
        put); waits for it, so the loader's streams can be closed safely afterwards."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)
            timeout -= 0.05
            if timeout <= 0:
                return


def pinned(value):
    """`value` with its CPU tensors in pinned memory (dicts, lists and tuples followed), so that copies to the GPU
    need not wait for the host."""
    if isinstance(value, torch.Tensor):
        return value.pin_memory() if value.device.type == "cpu" else value
    if isinstance(value, dict):
        return {k: pinned(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(pinned(v) for v in value)
    return value
