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

That count depends on how far the workers have read ahead, and counts again what a restored loader re-reads. A
`SkipLedger` attached to the counter fixes both: it notes *where* in each worker's stream a sample was dropped, so
the lane loader (`lane_loader.py`) counts a drop once the samples it consumed have reached that point.
"""

from __future__ import annotations

import multiprocessing
import threading
import traceback
from dataclasses import dataclass
from typing import Any

__all__ = ["SkipLedger", "SkipRecord", "SkippedSampleCounter", "sample_key_of"]

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

    def __init__(self, *, verbose: bool = False, max_records: int = 1000, ledger: SkipLedger | None = None):
        self.verbose = verbose
        self.max_records = max_records
        self.ledger = ledger
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
        if self.ledger is not None:
            self.ledger.note()

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


class SkipLedger:
    """Where each loader worker dropped samples, so that a drop counts when the consumed samples reach that point.

    energon numbers the samples each worker yields (the index is in the sample's restore key). A worker that drops
    a sample notes the index of the sample it will yield next, in shared memory, before yielding that sample; the
    main process, once it consumes a worker's sample with index i, counts that worker's notes up to i (`take`). So
    the count does not depend on how far the workers' prefetching has got, and samples re-read after a restore
    (energon replays from its last internal checkpoint) are not counted twice: notes below `floor` were counted
    before the save. (A shuffle buffer reads up to its size ahead of what it yields: its drops count that early.)

    One writer per worker slot (the worker), one reader (the main process): no lock is needed for the notes.
    """

    def __init__(self, num_workers: int, capacity: int = 1024):
        self.num_workers = max(1, num_workers)
        self.capacity = capacity  # notes a worker may run ahead of the reader (energon gives up after 100 in a row)
        self._notes = multiprocessing.Array("q", self.num_workers * capacity, lock=False)
        self._written = multiprocessing.Array("q", self.num_workers, lock=False)
        self._loose = multiprocessing.Value("q", 0)  # drops outside a worker's iteration: counted at once
        self._read = [0] * self.num_workers
        self._loose_read = 0
        self.pending: list[list[int]] = [[] for _ in range(self.num_workers)]
        self.floor = [0] * self.num_workers

    def note(self) -> None:
        """In the worker that drops a sample (called by `SkippedSampleCounter.record`)."""
        from megatron.energon import WorkerConfig

        config = WorkerConfig.active_worker_config
        if config is None:
            with self._loose.get_lock():
                self._loose.value += 1
            return
        worker = config.rank_worker_id()
        # active_worker_batch_index = (outermost sample index) * workers + worker: the index of the next yield
        index = (config.active_worker_batch_index - worker) // max(config.num_workers, 1)
        written = self._written[worker]
        self._notes[worker * self.capacity + written % self.capacity] = index
        self._written[worker] = written + 1

    def _drain(self, worker: int) -> int:
        """Move the worker's new notes to `pending`; return how many were lost to overflow (counted at once)."""
        written, lost = self._written[worker], 0
        if written - self._read[worker] > self.capacity:
            lost = written - self._read[worker] - self.capacity
            self._read[worker] = written - self.capacity
        for n in range(self._read[worker], written):
            index = self._notes[worker * self.capacity + n % self.capacity]
            if index >= self.floor[worker]:
                self.pending[worker].append(index)
        self._read[worker] = written
        return lost

    def take(self, worker: int, index: int) -> int:
        """Drops the stream of `worker` passed on its way to its sample `index` (not counted before)."""
        lost = self._drain(worker)
        passed = [i for i in self.pending[worker] if i <= index]
        self.pending[worker] = [i for i in self.pending[worker] if i > index]
        return lost + len(passed)

    def take_loose(self) -> int:
        value = self._loose.value
        count, self._loose_read = value - self._loose_read, value
        return count

    def notes_upto(self, worker: int, index: int) -> list[int]:
        """Uncounted notes up to `index` (the last sample pulled from `worker`): what a saved state must keep,
        since a restored worker resumes after that sample and will not meet those drops again."""
        self._drain(worker)
        return [i for i in self.pending[worker] if i <= index]

    def restore(self, worker: int, notes: list[int], pulled: int) -> None:
        """After a restore: keep the saved notes; ignore notes the worker makes while re-reading up to `pulled`."""
        self.pending[worker] = list(notes)
        self.floor[worker] = pulled + 1


def _describe(exception: Any) -> str:
    parts = [f"{type(exception).__name__}: {exception}"]
    cause = getattr(exception, "__cause__", None) or getattr(exception, "__context__", None)
    if cause is not None:
        parts.append(f"caused by {type(cause).__name__}: {cause}")
    return "; ".join(parts)
