"""`data_provider`'s return value against `mimo.plugins.DataSource`: what the loop calls on it, and what it must
give back. One ContractError names the first member missing or wrong.

`check_data_source` runs before the first micro-batch (what the loop makes of the value, and the members' kinds);
`check_capabilities` after some were read (what each call returns, as the loop would call it).
"""

from __future__ import annotations

from mimo.errors import UsageError
from mimo.plugins import DataSource
from mimo.plugins.data_source import as_data_source

from .report import ContractError

__all__ = ["check_capabilities", "check_data_source"]

METHODS = ("__next__", "state_dict", "load_state_dict", "data_counts", "take_skip_records", "size_note",
           "mark_boundary", "close")
_STATE = ("state_dict", "load_state_dict")


def _fail(rule: str) -> ContractError:
    return ContractError("data_provider", f"its DataSource: {rule} (mimo.plugins.DataSource; docs/provider-guide.md, "
                                          f"'The data source')")


def check_data_source(returned, provider: str | None = None) -> DataSource:
    """The DataSource the loop makes of `returned` (itself, or a plain iterator wrapped), its members checked."""
    try:
        source = as_data_source(returned, provider)
    except UsageError as err:
        raise ContractError("data_provider", str(err)) from None
    kind = type(source)  # a DataSource has every member (its own, or the defaults): check their kinds
    for name in METHODS:
        if not callable(getattr(source, name)):
            raise _fail(f"{kind.__name__}.{name} must be a method, got {type(getattr(source, name)).__name__}")
    if iter(source) is not source:
        raise _fail(f"iter() of a {kind.__name__} must return the source itself (the loop reads it as one stream)")
    for name, wanted in (("resumable", bool), ("hold_data_errors", bool), ("longest_needed", int)):
        value = getattr(source, name)
        if not isinstance(value, wanted):
            raise _fail(f"{kind.__name__}.{name} must be {wanted.__name__}, got {type(value).__name__}")
    if source.data_error is not None:
        raise _fail(f"{kind.__name__}.data_error must be None before anything failed, got {source.data_error!r}")
    if DataSource in kind.__mro__:  # a subclass: its state methods may be the defaults
        own = [name for name in _STATE if getattr(kind, name) is not getattr(DataSource, name)]
        if source.resumable and len(own) < 2:
            lacking = [name for name in _STATE if name not in own]
            raise _fail(f"{kind.__name__}.resumable is True but {' and '.join(lacking)} "
                        f"{'is' if len(lacking) == 1 else 'are'} DataSource's default: override both, or leave "
                        f"resumable False")
        if not source.resumable and own:
            raise _fail(f"{kind.__name__} overrides {' and '.join(own)} but resumable is False: the loop would never "
                        f"save its state (set resumable = True)")
    return source


def check_capabilities(source: DataSource) -> None:
    """Call each capability as the loop does after reading (no data error held) and check what it returns."""
    from mimo.data import DataCounts, SkipRecord  # energon and torch: only once data is read

    name = type(source).__name__
    counts = source.data_counts()
    if counts is not None and not isinstance(counts, DataCounts):
        raise _fail(f"{name}.data_counts() must return a mimo.data.DataCounts or None, got {type(counts).__name__}")
    records = source.take_skip_records()
    if not isinstance(records, list) or not all(isinstance(r, SkipRecord) for r in records):
        raise _fail(f"{name}.take_skip_records() must return a list of mimo.data.SkipRecord, got {records!r:.80}")
    note = source.size_note()
    if note is not None and (not isinstance(note, str) or "\n" in note.strip()):
        raise _fail(f"{name}.size_note() must return one line or None, got {note!r:.80}")
    if source.longest_needed < 0:
        raise _fail(f"{name}.longest_needed must be 0 or more, got {source.longest_needed}")
    state = source.state_dict()
    if source.resumable and not isinstance(state, dict):
        raise _fail(f"{name}.state_dict() must return a dict (resumable is True), got {type(state).__name__}")
    if not source.resumable and state is not None:
        raise _fail(f"{name}.state_dict() returned a state but resumable is False: the loop would save a state "
                    f"it cannot restore (set resumable = True)")
    source.mark_boundary()
