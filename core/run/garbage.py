"""Python's garbage collector during training (--gc-interval).

Left to itself, the collector runs a full pass whenever enough objects have survived earlier passes: at points
set by allocation counts, in the middle of an iteration, walking every object the process holds (millions, with
torch, megatron-core and transformer-engine loaded). While it runs nothing is launched, and the GPU idles. So the
objects built before the first iteration (libraries, modules, the optimizer) are frozen when training starts: the
collector's passes never walk them again, only what training creates. With an interval the collector's own passes
are off too, and one pass runs at the end of every N-th iteration. Its previous state comes back when training
ends.
"""

from __future__ import annotations

import gc


class GarbageCollection:
    """`interval`: iterations between collections; 0 leaves the passes to the collector."""

    def __init__(self, interval: int):
        self.interval = interval
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        gc.collect()  # what start-up left unreachable goes before the rest is frozen
        gc.freeze()
        if self.interval:
            gc.disable()

    def after(self, iteration: int) -> None:
        if self.interval and iteration % self.interval == 0:
            gc.collect()

    def stop(self) -> None:
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
