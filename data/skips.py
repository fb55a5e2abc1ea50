"""Counting the samples the data pipeline skips, and what each one was.

energon 7.4.1 routes every exception raised while loading a sample (decoding its files: a corrupt JPEG raises
`webdataset.autodecode.DecodingError` inside the dataset's MapDataset) or while encoding / batching it (the task
encoder) to `WorkerConfig.global_error_handler(exception, sample, sources)`; when the handler returns, the sample is
dropped and iteration goes on (after 100 consecutive failures of one stage energon raises `FatalSampleError`).
`SkippedSampleCounter` is such a handler: it counts and records what it was given (the sample's key, its dataset
and shard from energon's source info, the error) instead of printing a traceback. Samples a task encoder drops on
purpose (`SkipSample`, e.g. an image that does not fit the sequence) never reach that handler, so
`MultimodalTaskEncoder` reports them to the counter itself, under another reason; the sample being encoded
(`encoding_sample`, set by `deferred_errors.py`) supplies their shard.

The count lives in shared memory, so it also sums the skips of DataLoader worker processes started after the
counter was made; the `records` list is per process.

That count depends on how far the workers have read ahead, and counts again what a restored loader re-reads. A
`SkipLedger` attached to the counter fixes both: it notes *where* in each worker's stream a sample was dropped,
with its record, so the lane loader (`lane_loader.py`) counts a drop, and reports it, once the samples it consumed
have reached that point.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import re
import threading
import traceback
from dataclasses import dataclass
from typing import Any

__all__ = ["SkipLedger", "SkipRecord", "SkippedSampleCounter", "UnreadableSample", "describe_error",
           "encoding_sample", "sample_key_of"]

DECODE_ERROR = "error"  # an exception from loading/decoding/encoding a sample, reported by energon
TOO_LONG = "too_long"  # dropped by the task encoder: the image tokens alone exceed the sequence budget
REASONS = {DECODE_ERROR: "unreadable", TOO_LONG: "too long"}


@dataclass(frozen=True)
class SkipRecord:
    key: str | None
    reason: str
    error: str
    sources: tuple = ()
    dataset: str | None = None  # the dataset's path (of a blend's datasets, the one the sample came from)
    shard: str | None = None  # the shard's file name within it

    def describe(self) -> str:
        """`dataset D, shard S, key K: error` -- what a skip line says about the sample."""
        return (f"dataset {self.dataset or '?'}, shard {self.shard or '?'}, key {self.key or '?'}: "
                f"{self.error or REASONS.get(self.reason, self.reason)}")

    # A record crosses from a loader worker to the main process as one fixed-size text slot (see SkipLedger).
    def pack(self, size: int) -> bytes:
        text = _SEP.join((self.reason, self.dataset or "", self.shard or "", self.key or "", self.error))
        return text.encode("utf-8")[:size]

    @classmethod
    def unpack(cls, data: bytes) -> SkipRecord:
        fields = data.rstrip(b"\0").decode("utf-8", errors="ignore").split(_SEP, 4)
        reason, dataset, shard, key, error = fields + [""] * (5 - len(fields))
        return cls(key=key or None, reason=reason or DECODE_ERROR, error=error, dataset=dataset or None,
                   shard=shard or None)


_SEP = "\x1f"
_current = threading.local()


@contextlib.contextmanager
def encoding_sample(sample: Any):
    """While a task encoder encodes `sample`: a skip it records without sources names this sample's shard."""
    previous = getattr(_current, "sample", None)
    _current.sample = sample
    try:
        yield
    finally:
        _current.sample = previous


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


def _sources_of(sample: Any) -> list | None:
    from megatron.energon.source_info import get_source_info

    return get_source_info(sample) if sample is not None else None


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
        self.record(sample_key_of(sample), DECODE_ERROR, exception, sources or _sources_of(sample))

    def record(self, key: str | None, reason: str, error: Any = "", sources: list | None = None) -> None:
        current = getattr(_current, "sample", None)
        if current is not None:  # a task encoder's own skip: the sample being encoded says where it came from
            key = key if key is not None else sample_key_of(current)
            sources = sources or _sources_of(current)
        source = next((s for s in sources or () if hasattr(s, "shard_name")), None)
        entry = SkipRecord(key=key, reason=reason, error=error if isinstance(error, str) else describe_error(error),
                           sources=tuple(sources or ()),
                           dataset=str(source.dataset_path) if source is not None else None,
                           shard=source.shard_name if source is not None else None)
        with self._lock:
            self._local += 1
            if len(self.records) < self.max_records:
                self.records.append(entry)
        if self._shared is not None:
            with self._shared.get_lock():
                self._shared.value += 1
        if self.ledger is not None:
            self.ledger.note(entry)

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
    a sample notes the index of the sample it will yield next, with the drop's record, in shared memory, before
    yielding that sample; the main process, once it consumes a worker's sample with index i, takes that worker's
    notes up to i (`take`). So the count does not depend on how far the workers' prefetching has got, and samples
    re-read after a restore (energon replays from its last internal checkpoint) are not counted twice: notes below
    `floor` were counted before the save. Drops before the shuffle buffer would count up to its size early;
    `deferred_errors.py` moves load errors after it.

    One writer per worker slot (the worker), one reader (the main process): no lock is needed for the notes.
    Drops outside a worker's iteration share one extra slot, under a lock, and count at once.
    """

    RECORD_BYTES = 512  # one record's text (key, shard, error) as it crosses processes; longer errors are cut

    def __init__(self, num_workers: int, capacity: int = 1024):
        self.num_workers = max(1, num_workers)
        self.capacity = capacity  # notes a worker may run ahead of the reader (energon gives up after 100 in a row)
        slots = self.num_workers + 1  # the last: drops outside a worker's iteration
        self._notes = multiprocessing.Array("q", slots * capacity, lock=False)
        self._records = multiprocessing.Array("c", slots * capacity * self.RECORD_BYTES, lock=False)
        self._written = multiprocessing.Array("q", slots, lock=False)
        self._loose_lock = multiprocessing.Lock()
        self._read = [0] * slots
        self.pending: list[list[tuple[int, SkipRecord]]] = [[] for _ in range(slots)]
        self.floor = [0] * slots

    def note(self, record: SkipRecord) -> None:
        """In the worker that drops a sample (called by `SkippedSampleCounter.record`)."""
        from megatron.energon import WorkerConfig

        config = WorkerConfig.active_worker_config
        if config is None:
            with self._loose_lock:
                self._write(self.num_workers, -1, record)
            return
        worker = config.rank_worker_id()
        # active_worker_batch_index = (outermost sample index) * workers + worker: the index of the next yield
        index = (config.active_worker_batch_index - worker) // max(config.num_workers, 1)
        self._write(worker, index, record)

    def _write(self, slot: int, index: int, record: SkipRecord) -> None:
        written = self._written[slot]
        n = slot * self.capacity + written % self.capacity
        self._notes[n] = index
        size = self.RECORD_BYTES
        self._records[n * size:(n + 1) * size] = record.pack(size).ljust(size, b"\0")
        self._written[slot] = written + 1  # last: the reader sees a note only once it is complete

    def _drain(self, slot: int) -> list[SkipRecord]:
        """Move the slot's new notes to `pending`; return records lost to overflow (they count at once)."""
        written, lost = self._written[slot], []
        if written - self._read[slot] > self.capacity:
            missed = written - self._read[slot] - self.capacity
            lost = [SkipRecord(key=None, reason=DECODE_ERROR,
                               error=f"(one of {missed} skips noted faster than the loader read them)")] * missed
            self._read[slot] = written - self.capacity
        size = self.RECORD_BYTES
        for i in range(self._read[slot], written):
            n = slot * self.capacity + i % self.capacity
            index = self._notes[n]
            if index >= self.floor[slot] or index < 0:
                self.pending[slot].append((index, SkipRecord.unpack(bytes(self._records[n * size:(n + 1) * size]))))
        self._read[slot] = written
        return lost

    def take(self, worker: int, index: int) -> list[SkipRecord]:
        """The drops the stream of `worker` passed on its way to its sample `index` (not taken before)."""
        lost = self._drain(worker)
        passed = [record for i, record in self.pending[worker] if i <= index]
        self.pending[worker] = [(i, record) for i, record in self.pending[worker] if i > index]
        return lost + passed

    def take_loose(self) -> list[SkipRecord]:
        """Drops outside a worker's iteration, not taken before."""
        slot = self.num_workers
        records = self._drain(slot) + [record for _, record in self.pending[slot]]
        self.pending[slot] = []
        return records

    def notes_upto(self, worker: int, index: int) -> list[list]:
        """Uncounted notes up to `index` (the last sample pulled from `worker`), as `[index, record text]`: what a
        saved state must keep, since a restored worker resumes after that sample and will not meet those drops
        again."""
        self._drain(worker)
        return [[i, record.pack(self.RECORD_BYTES).decode("utf-8", errors="ignore")]
                for i, record in self.pending[worker] if i <= index]

    def restore(self, worker: int, notes: list, pulled: int) -> None:
        """After a restore: keep the saved notes; ignore notes the worker makes while re-reading up to `pulled`.
        (A note saved by an older mimo is a bare index: its record is unknown.)"""
        self.pending[worker] = [
            (note, SkipRecord(key=None, reason=DECODE_ERROR, error="")) if isinstance(note, int)
            else (int(note[0]), SkipRecord.unpack(str(note[1]).encode("utf-8")))
            for note in notes
        ]
        self.floor[worker] = pulled + 1


class UnreadableSample(ValueError):
    """A sample whose loading failed before the shuffle buffer, raised where it leaves the buffer (its message says
    which file and why)."""


def describe_error(exception: Any) -> str:
    """One line: the error and what caused it, without object addresses (`<_io.BytesIO object at 0x...>`). An
    error without a message of its own (webdataset's DecodingError) is described by its cause."""
    if isinstance(exception, UnreadableSample):
        return str(exception)
    cause = getattr(exception, "__cause__", None)  # `raise ... from`: not whatever was being handled
    if cause is not None and not str(exception).strip():
        return describe_error(cause)
    return _one_line(exception) + (f"; caused by {_one_line(cause)}" if cause is not None else "")


def _one_line(exception: Any) -> str:
    text = re.sub(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>", "", str(exception)).strip()
    text = " ".join(text.split())
    return f"{type(exception).__name__}: {text}" if text else type(exception).__name__
