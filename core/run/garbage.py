"""Python's garbage collector during training (--gc-interval).

Left to itself, the collector runs a pass whenever enough objects have been allocated, at points set by allocation
counts: in the middle of an iteration, and at different points on different ranks, where a pass over the
millions of objects a training process holds (torch, megatron-core, transformer-engine, the model's modules) stalls
the rank's launches and makes the others wait for it. With an interval, the objects built before the first
iteration are frozen when training starts (no pass walks them again), the collector's own passes are off, and one
pass runs at the end of every N-th iteration, on every rank at the same iteration. Its previous state comes back
when training ends. The logs' `gc_ms` (telemetry/gc_pauses.py) says what the collector costs either way.
"""

from __future__ import annotations

import gc


class GarbageCollection:
    """`interval`: iterations between collections; 0 leaves the collector as it is."""

    def __init__(self, interval: int):
        self.interval = interval
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        if not self.interval:
            return
        gc.collect()  # what start-up left unreachable goes before the rest is frozen
        gc.freeze()
        gc.disable()

    def after(self, iteration: int) -> None:
        if self.interval and iteration % self.interval == 0:
            gc.collect()

    def stop(self) -> None:
        if not self.interval:
            return
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
