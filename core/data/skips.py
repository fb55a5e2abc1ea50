"""Counting the samples the data pipeline skips.

energon 7.4.1 routes every exception raised while loading a sample (decoding its files: a corrupt JPEG raises
`webdataset.autodecode.DecodingError` inside the dataset's MapDataset) or while encoding / batching it (the task
encoder) to `WorkerConfig.global_error_handler(exception, sample, sources)`; when the handler returns, the sample is
dropped and iteration goes on (after 100 consecutive failures of one stage energon raises `FatalSampleError`).
`SkippedSampleCounter` is such a handler: it counts and records what it was given instead of only printing a
traceback. Samples a task encoder drops on purpose (`SkipSample`, e.g. an image that does not fit the sequence)
never reach that handler, so `MultimodalTaskEncoder` reports them to the counter itself, under another reason.

The count lives in shared memory, so it also sums the skips of DataLoader worker processes started after the
counter was made; the `records` list (keys and messages) is per process.
"""

from __future__ import annotations

import multiprocessing
import threading
import traceback
from dataclasses import dataclass
from typing import Any

__all__ = ["SkipRecord", "SkippedSampleCounter", "sample_key_of"]

DECODE_ERROR = "error"  # an exception from loading/decoding/encoding a sample, reported by energon
TOO_LONG = "too_long"  # dropped by the task encoder: the image tokens alone exceed the sequence budget


@dataclass(frozen=True)
class SkipRecord:
    key: str | None
    reason: str
    error: str
    sources: tuple = ()


def sample_key_of(sample: Any) -> str | None:
    """The `__key__` of an energon sample, a raw (undecoded) sample, a dict, or the first of a list of them."""
    if sample is None:
        return None
    if isinstance(sample, (list, tuple)) and sample and not isinstance(sample, str):
        return sample_key_of(sample[0])
    if isinstance(sample, dict):
        return sample.get("__key__")
    key = getattr(sample, "__key__", None)
    if key is not None:
        return key
    data = getattr(sample, "data", None)  # energon's RawSampleData: a tuple of raw sample dicts
    if isinstance(data, tuple) and data and isinstance(data[0], dict):
        return data[0].get("__key__")
    return None


class SkippedSampleCounter:
    """An energon error handler that counts and records skipped samples instead of crashing.

    Use as `WorkerConfig(..., global_error_handler=counter)`. `count` is the total over all processes that share
    it; `counts()` gives it per reason for this process's records; `records` holds up to `max_records` entries.
    With `verbose`, each error is also printed with its traceback (energon's default `log_exception` behaviour).
    """

    def __init__(self, *, verbose: bool = False, max_records: int = 1000):
        self.verbose = verbose
        self.max_records = max_records
        self.records: list[SkipRecord] = []
        self._lock = threading.Lock()
        self._shared = multiprocessing.Value("q", 0)
        self._local = 0

    # energon's handler signature
    def __call__(self, exception: BaseException, sample: Any = None, sources: list | None = None) -> None:
        if self.verbose:
            traceback.print_exception(exception)
        self.record(sample_key_of(sample), DECODE_ERROR, exception, sources)

    def record(self, key: str | None, reason: str, error: Any = "", sources: list | None = None) -> None:
        message = error if isinstance(error, str) else _describe(error)
        with self._lock:
            self._local += 1
            if len(self.records) < self.max_records:
                self.records.append(SkipRecord(key=key, reason=reason, error=message,
                                               sources=tuple(sources or ())))
        if self._shared is not None:
            with self._shared.get_lock():
                self._shared.value += 1

    @property
    def count(self) -> int:
        return int(self._shared.value) if self._shared is not None else self._local

    @property
    def local_count(self) -> int:
        """Skips recorded in this process only."""
        return self._local

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            out[r.reason] = out.get(r.reason, 0) + 1
        return out

    @property
    def keys(self) -> list[str | None]:
        return [r.key for r in self.records]

    def reset(self) -> None:
        with self._lock:
            self.records.clear()
            self._local = 0
        if self._shared is not None:
            with self._shared.get_lock():
                self._shared.value = 0

    def __getstate__(self):
        state = self.__dict__.copy()
        del state["_lock"]
        # A shared Value can only travel to a process being started; pickled any other way (e.g. copied into a
        # checkpoint or config), the counter carries on with a private count.
        from multiprocessing.context import get_spawning_popen

        if get_spawning_popen() is None:
            state["_shared"] = None
            state["_local"] = self.count
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"SkippedSampleCounter(count={self.count}, by_reason={self.counts()})"


def _describe(exception: Any) -> str:
    parts = [f"{type(exception).__name__}: {exception}"]
    cause = getattr(exception, "__cause__", None) or getattr(exception, "__context__", None)
    if cause is not None:
        parts.append(f"caused by {type(cause).__name__}: {cause}")
    return "; ".join(parts)
