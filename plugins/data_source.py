"""What a provider's `data_provider` returns: a `DataSource`, the iterator of micro-batches the loop reads.

The required part is the iterator: `__next__()` gives this rank's next micro-batch (the dict in
`hookspecs.data_provider`), `__iter__()` the source itself. Everything else is an optional capability with a
default that does nothing; the loop calls every one of them, unconditionally, at the moments their docstrings
name. A source overrides the ones it can do:

    resumable, state_dict, load_state_dict   exact resume from a checkpoint (saved per lane)
    data_counts, take_skip_records           samples trained and skipped, the work trained: the log (throughput
                                             without padding), the skip guard, the skip lines
    longest_needed, size_note                the truncation warning, the note on a dataset smaller than a batch
    hold_data_errors, data_error,            a data error mid-run: finish the iteration with empty micro-batches,
    mark_boundary                            then stop at its boundary and save the state kept there
    close                                    worker processes or threads stopped at the end

Three ways to be one:
- subclass `DataSource` (the defaults fill what it does not override);
- define every member in the class itself: such a class is a DataSource without subclassing (`issubclass` says
  so), which is how `mimo.data.LaneLoader` is one, since mimo.data may not import mimo.plugins;
- return a plain iterator or generator with none of the members: the loop wraps it (`IteratorSource`), with the
  defaults, and closes a generator at the end.

An iterator with some of the members but not a DataSource (`state_dict` and `data_counts` on a plain iterator
were how mimo's API said it before) is refused with a `UsageError` that says to subclass `DataSource`: wrapped,
it would lose its resumable state without a word.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from mimo.errors import UsageError

if TYPE_CHECKING:  # mimo.data imports energon and torch: a provider listing needs neither
    from mimo.data import DataCounts, SkipRecord

__all__ = ["CAPABILITIES", "DataSource", "IteratorSource", "as_data_source"]

# The optional members, each with its default in DataSource; with __next__ and __iter__, the whole contract.
CAPABILITIES = ("resumable", "state_dict", "load_state_dict", "data_counts", "take_skip_records", "longest_needed",
                "size_note", "hold_data_errors", "data_error", "mark_boundary", "close")
MEMBERS = ("__next__", "__iter__", *CAPABILITIES)
# What DataContext documented on a plain iterator before DataSource: an iterator with one of them is refused.
_FORMER = ("state_dict", "load_state_dict", "data_counts")


class DataSource(metaclass=ABCMeta):
    """An iterator of this rank's micro-batches, with the optional capabilities the loop uses (module docstring)."""

    # Whether `state_dict`/`load_state_dict` continue the exact stream. Read at start: a resumable source is saved
    # in checkpoints (per lane) and never read ahead by the loop's thread (its state would run ahead of training).
    resumable: bool = False
    # Set to True by the training loop right after data_provider: on a data error mid-run, keep it in `data_error`
    # and hand out empty micro-batches (no loss) until the iteration ends, so every rank reaches its boundary.
    hold_data_errors: bool = False
    # The held data error's one-line message, or None. Read after every iteration; set, the loop stops and saves
    # the state `mark_boundary` kept.
    data_error: str | None = None
    # The longest whole sample read so far, in tokens (what seq_length would need to cut none). Read when the log
    # warns about truncated samples; 0: unknown.
    longest_needed: int = 0

    @abstractmethod
    def __next__(self) -> dict:
        """The next micro-batch (hookspecs.data_provider's schema). The loop reads as many as it trains: yield
        forever, or raise StopIteration when the data ends."""

    def __iter__(self) -> DataSource:
        return self

    def state_dict(self) -> dict | None:
        """Everything needed to continue the exact stream (plain types, bytes), or None. Called at every
        checkpoint save; what it returns comes back to `load_state_dict` on resume."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (what `state_dict` gave). Called on resume, before the first `__next__`, and only
        when `resumable`; a source that is not refuses a checkpoint holding a loader's state before this."""
        raise UsageError(f"{type(self).__name__} keeps no data state to resume from (resumable is False)")

    def data_counts(self) -> DataCounts | None:
        """What this rank consumed over the run (`mimo.data.DataCounts`: samples trained, skipped by reason, cut
        by seq_length; the trained samples' tokens, images, rows and FLOPs), or None: counts nothing. Called once
        before the first micro-batch (a resumed run's counts: its throughput counts from there), after every
        iteration (the log, the skip guard) and after every evaluation."""
        return None

    def take_skip_records(self) -> list[SkipRecord]:
        """The skips counted since the last call (`mimo.data.SkipRecord`: which sample, why), in order. Called
        after every iteration, on every rank (so none piles them up); the counting rank prints a line for each."""
        return []

    def size_note(self) -> str | None:
        """A one-line note when the data is smaller than a micro-batch (samples repeat), or None. Called once at
        start, after the first micro-batch; the logging rank prints it."""
        return None

    def mark_boundary(self) -> None:
        """Keep the state as of now, an iteration boundary: what `state_dict` returns after a held data error.
        Called after every iteration of a run that saves (--save), unless that iteration met a data error."""

    def close(self) -> None:
        """Stop worker processes and threads now; the source is done. Called once at the end of the run (and of
        every evaluation), or when it stops."""

    @classmethod
    def __subclasshook__(cls, other: type) -> bool:
        # A class that defines every member is a DataSource without subclassing (mimo.data's LaneLoader).
        if cls is DataSource:
            defined = {name for klass in other.__mro__ for name in vars(klass)}
            if all(member in defined for member in MEMBERS):
                return True
        return NotImplemented


class IteratorSource(DataSource):
    """A plain iterator as a DataSource with the defaults: what the loop makes of a provider's generator."""

    def __init__(self, iterable: Iterable):
        self._iterator: Iterator = iter(iterable)

    def __next__(self) -> dict:
        return next(self._iterator)

    def close(self) -> None:
        if isinstance(self._iterator, Generator):  # its `finally` blocks run now, not when it is collected
            self._iterator.close()


def as_data_source(returned: Any, provider: str | None = None) -> DataSource:
    """What `data_provider` returned, as a DataSource: itself, or a plain iterator wrapped (module docstring).
    Raises UsageError for what is neither."""
    if isinstance(returned, DataSource):
        return returned
    who = f"data_provider of provider '{provider}'" if provider else "data_provider"
    name = type(returned).__name__
    former = [member for member in _FORMER if hasattr(returned, member)]  # the one place the old API is probed
    if former:
        raise UsageError(f"{who} returned {name}, which has {', '.join(former)} but is not a "
                         f"mimo.plugins.DataSource: subclass DataSource (with resumable = True for a state) so the "
                         f"loop uses them (docs/provider-guide.md, 'The data source')")
    if not isinstance(returned, Iterable):
        raise UsageError(f"{who} returned {name}: it must return an iterator of micro-batches (a "
                         f"mimo.plugins.DataSource, or a generator)")
    return IteratorSource(returned)
