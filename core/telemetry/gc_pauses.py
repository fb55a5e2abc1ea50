"""Time the process spends in Python's garbage collector, for the logs.

A full collection walks every tracked Python object; a training process holds millions (torch, megatron-core,
transformer-engine, the model's modules), so one pass can stall the host for a large share of an iteration while
the GPU waits for kernels. `gc.callbacks` tells when each pass starts and stops; the meter sums them between two
reads.
"""

from __future__ import annotations

import gc
import time


class GcPauses:
    """Sums the time of the collector's passes (any generation) between two `take()` calls."""

    def __init__(self):
        self._started: float | None = None
        self.seconds, self.passes = 0.0, 0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self.passes += 1
            self._started = None

    def take(self) -> tuple[float, int]:
        """(seconds, passes) since the last take."""
        taken = self.seconds, self.passes
        self.seconds, self.passes = 0.0, 0
        return taken

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
