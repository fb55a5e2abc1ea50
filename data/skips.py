"""What a sample that cannot be trained on was, and how it is counted: at consumption, once.

A sample mimo cannot train on is not dropped inside energon. `deferred_errors.py` turns it into a *tombstone*: an
`EncodedSample` with no tokens that carries a `SkipRecord` (why, and the sample's dataset, shard and key). The
tombstone takes the sample's slot in the shuffle buffer, the packing buffer, the worker queues and the saved
loader state like any sample, so the lane loader (`lane_loader.py`) counts it exactly when training would have
consumed the sample: once, whatever energon read ahead or replays after a restore, packed or not.

Reasons are apart:
  unreadable   a file cannot be decoded, a part the dataset's field map names is missing, a crude sample cannot
               be cooked because a file is broken, its shard is damaged there (`damaged_shards.py`)
  unsupported  decoded, but mimo cannot train on the content (a chat form or role it does not know, placeholders
               that do not match the images, an image with an unusable channel count, nothing to train on)
  too_long     cut to seq_length, the sample leaves fewer than `min_text_tokens` tokens to train on
  over_image_budget  packed, the sample's images take more image tokens than a row's image budget
               (`--pack-image-tokens`): a longer seq_length does not help, smaller images or a larger budget do

What still fails inside energon (e.g. a joined dataset's own loading) reaches `SkippedSampleCounter`, energon's
error handler, and counts at once as unreadable: the only count that does not wait for consumption.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
import traceback
from dataclasses import dataclass
from typing import Any

__all__ = ["OVER_IMAGE_BUDGET", "REASONS", "SkipRecord", "SkippedSampleCounter", "TOO_LONG", "TooLong", "UNREADABLE",
           "UNSUPPORTED",
           "UnreadableSample", "UnreadableShard", "UnsupportedSample", "describe_error", "record_of",
           "sample_key_of"]

UNREADABLE, UNSUPPORTED, TOO_LONG, OVER_IMAGE_BUDGET = "unreadable", "unsupported", "too_long", "over_image_budget"
REASONS = {UNREADABLE: "unreadable", UNSUPPORTED: "unsupported", TOO_LONG: "too long for seq_length",
           OVER_IMAGE_BUDGET: "images over a packed row's image budget"}


@dataclass(frozen=True)
class SkipRecord:
    key: str | None
    reason: str
    error: str
    dataset: str | None = None  # the dataset's path (of a blend's datasets, the one the sample came from)
    shard: str | None = None  # the shard's file name within it
    needed_tokens: int | None = None  # too_long: the tokens the whole sample needs
    whole_shard: bool = False  # unreadable: its shard cannot be opened at all (the run stops, naming it)

    def describe(self) -> str:
        """`(why): dataset D, shard S, key K: error` -- what a skip line says about the sample."""
        return (f"({REASONS.get(self.reason, self.reason)}): dataset {self.dataset or '?'}, shard "
                f"{self.shard or '?'}, key {self.key or '?'}: {self.error or REASONS.get(self.reason, self.reason)}")


class UnreadableSample(ValueError):
    """A sample a file of which could not be read (its message says which file and why)."""


class UnreadableShard(UnreadableSample):
    """A sample whose whole shard cannot be opened (its message says which and why)."""


class UnsupportedSample(ValueError):
    """A sample that was read but holds content mimo cannot train on (its message says what)."""


class TooLong(Exception):
    """The sample cut to seq_length leaves nothing to train on (`reason` TOO_LONG), or its images do not fit a
    packed row's image budget (OVER_IMAGE_BUDGET); `needed_tokens`: its whole length."""

    def __init__(self, message: str, needed_tokens: int, reason: str = TOO_LONG):
        super().__init__(message)
        self.needed_tokens, self.reason = needed_tokens, reason


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
    inner = _raw_inner(sample)
    return inner.get("__key__") if inner is not None else None


def _raw_inner(sample: Any) -> dict | None:
    """energon's RawSampleData holds a tuple of raw sample dicts; their first, else None."""
    data = getattr(sample, "data", None)
    return data[0] if isinstance(data, tuple) and data and isinstance(data[0], dict) else None


def _sources_of(sample: Any) -> list | None:
    from megatron.energon.source_info import get_source_info

    if sample is None:
        return None
    inner = _raw_inner(sample)
    return get_source_info(inner if inner is not None else sample)


def record_of(sample: Any, reason: str, error: Any, sources: list | None = None,
              needed_tokens: int | None = None, whole_shard: bool = False) -> SkipRecord:
    """The record of `sample` (a Sample, a raw sample, a dict): its key, dataset and shard, why it was skipped."""
    try:
        sources = sources or _sources_of(sample)
    except Exception:  # noqa: BLE001 - a sample without source info still gets its record
        sources = None
    source = next((s for s in sources or () if hasattr(s, "shard_name")), None)
    return SkipRecord(key=sample_key_of(sample), reason=reason,
                      error=error if isinstance(error, str) else describe_error(error),
                      dataset=str(source.dataset_path) if source is not None else None,
                      shard=source.shard_name if source is not None else None, needed_tokens=needed_tokens,
                      whole_shard=whole_shard)


class SkippedSampleCounter:
    """An energon error handler that counts and records skipped samples instead of crashing.

    Use as `WorkerConfig(..., global_error_handler=counter)`. `count` is the total over all processes that share
    it (a shared Value made before the workers start); `records` holds this process's first `max_records`. With
    `verbose`, each error is also printed with its traceback (energon's default `log_exception` behaviour).
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
        reason = (exception.reason if isinstance(exception, TooLong) else
                  UNSUPPORTED if isinstance(exception, UnsupportedSample) else UNREADABLE)
        self.add(record_of(sample, reason, exception, sources))

    def add(self, entry: SkipRecord) -> None:
        with self._lock:
            self._local += 1
            if len(self.records) < self.max_records:
                self.records.append(entry)
        if self._shared is not None:
            with self._shared.get_lock():
                self._shared.value += 1

    @property
    def count(self) -> int:
        return int(self._shared.value) if self._shared is not None else self._local

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            out[r.reason] = out.get(r.reason, 0) + 1
        return out

    @property
    def keys(self) -> list[str | None]:
        return [r.key for r in self.records]

    def take_records(self) -> list[SkipRecord]:
        with self._lock:
            taken, self.records = self.records, []
        return taken

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


def describe_error(exception: Any) -> str:
    """One line: the error and what caused it, without object addresses (`<_io.BytesIO object at 0x...>`). An
    error without a message of its own (webdataset's DecodingError) is described by its cause."""
    if isinstance(exception, (UnreadableSample, UnsupportedSample, TooLong)):
        return str(exception)
    cause = getattr(exception, "__cause__", None)  # `raise ... from`: not whatever was being handled
    if cause is not None and not str(exception).strip():
        return describe_error(cause)
    return _one_line(exception) + (f"; caused by {_one_line(cause)}" if cause is not None else "")


def _one_line(exception: Any) -> str:
    text = re.sub(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>", "", str(exception)).strip()
    text = " ".join(text.split())
    return f"{type(exception).__name__}: {text}" if text else type(exception).__name__
