"""Where the host waits for the GPU: during a profiled window on a GPU, torch's synchronization debug mode warns at
every synchronizing CUDA call (a `.item()`, a device-to-host copy, a `nonzero()`), and this records the Python call
site of each, so the profile's summary names the waits and the code that causes them (a wait drains the GPU's
queue: the GPU then idles while the host launches the next kernels).
"""

from __future__ import annotations

import collections
import traceback
import warnings

import torch

_MARK = "synchroniz"  # torch's warning: "called a synchronizing CUDA operation"
_SKIPPED = ("/torch/", "/warnings.py", "/contextlib.py", "sync_sites.py")


class SyncSites:
    """A context that counts synchronizing CUDA calls by call site (the innermost frames outside torch)."""

    def __init__(self, frames: int = 3):
        self.frames = frames
        self.sites: collections.Counter[str] = collections.Counter()

    def __enter__(self):
        self._gpu = torch.cuda.is_available()  # the debug mode needs a CUDA device; without one nothing waits
        self._previous_mode = torch.cuda.get_sync_debug_mode() if self._gpu else None
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()  # restores the filters and showwarning on exit
        warnings.filterwarnings("always", message=f".*{_MARK}")
        self._show = warnings.showwarning
        warnings.showwarning = self.record
        if self._gpu:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self._gpu:
            torch.cuda.set_sync_debug_mode(self._previous_mode)
        self._catch.__exit__(*exc)
        return False

    def record(self, message, category, filename, lineno, file=None, line=None):
        if _MARK not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        stack = [f for f in traceback.extract_stack()[:-1] if not any(s in f.filename for s in _SKIPPED)]
        where = " <- ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack[-self.frames:]))
        self.sites[where or f"{_short(filename)}:{lineno}"] += 1
        return None

    def top(self, iterations: int, count: int = 10) -> list[dict]:
        """The call sites with the most waits, per iteration."""
        return [{"per_iteration": n / iterations, "site": site} for site, n in self.sites.most_common(count)]


def _short(path: str) -> str:
    """A file's path from its package on (megatron/core/..., transformer_engine/..., mimo's own)."""
    for root in ("megatron/", "transformer_engine/", "mamba_ssm/", "site-packages/"):
        if root in path:
            return path[path.index(root):].removeprefix("site-packages/")
    parts = path.split("/")
    return "/".join(parts[-3:])
