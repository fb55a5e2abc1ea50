"""A sample that cannot be trained on becomes a tombstone in the stream, where training would have met it.

energon decodes a sample's files, applies its dataset's field map, and cooks a crude sample before its shuffle
buffer; an error there would drop the sample while the buffer reads ahead. `defer_load_errors` gives the lane
loader a copy of the task encoder in which such a failure travels with the sample instead:

* its decoder (`DeferringDecoder`, the task encoder's `decoder`, which energon hands to the dataset) puts an
  `UnreadablePart` in place of a file that cannot be decoded;
* each dataset's raw-sample loader (its field map) hands on a sample it could not load, with the error attached
  (`UNCOOKED`), and so does `cook_crude_sample` for a crude sample it could not cook;
* its first step after the buffer (`encode_sample`, or `preencode_sample` where the encoder has one) returns a
  tombstone (`task_encoder.tombstone`: no tokens, the sample's `SkipRecord`) for such a sample, and for a sample
  the encoder itself rejects (unsupported content, too long for seq_length).

So the bad sample keeps its slot in the shuffle and packing buffers, and the lane loader counts it when it consumes
that slot (`skips.py`). Nothing is dropped inside energon, so energon's error handler sees only what fails in its
own code.

The copy's methods are instance attributes made of `functools.partial` over module functions, so the copy pickles
(for worker processes started by spawning) and energon reads their `@stateless` marks as it would the originals'.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from typing import Any

from megatron.energon import SkipSample, TaskEncoder
from megatron.energon.errors import SYSTEM_EXCEPTIONS
from megatron.energon.flavors.webdataset.sample_decoder import SampleDecoder

from .damaged_shards import SHARD_UNREADABLE, UNCOOKED, guard_shard_reads
from .skips import (
    UNREADABLE, UNSUPPORTED, TooLong, UnreadableSample, UnreadableShard, UnsupportedSample,
    describe_error, record_of,
)
from .task_encoder import tombstone

__all__ = ["DeferringDecoder", "UNCOOKED", "UnreadablePart", "UnreadableSample", "defer_dataset_errors",
           "defer_load_errors", "raise_if_unreadable"]

_MARKS = ("__stateless__", "__failure_tolerance__")  # what energon reads off a task encoder's method


class UnreadablePart:
    """Stands in for a sample's file that could not be decoded: its name and the error."""

    __slots__ = ("name", "error")

    def __init__(self, name: str, error: str):
        self.name, self.error = name, error

    def __getstate__(self):
        return self.name, self.error

    def __setstate__(self, state):
        self.name, self.error = state

    def __repr__(self) -> str:
        return f"UnreadablePart({self.name!r}: {self.error})"


class DeferringDecoder(SampleDecoder):
    """A task encoder's decoder that returns an `UnreadablePart` for a file it cannot decode instead of raising.

    The other files of the sample are decoded as usual (each alone, once the sample as a whole has failed)."""

    def __init__(self, inner: SampleDecoder):  # not super().__init__: that would build a second webdataset decoder
        self.inner = inner

    def __call__(self, sample: dict) -> dict:
        try:
            return self.inner(sample)
        except SYSTEM_EXCEPTIONS:
            raise
        except Exception:  # noqa: BLE001 - which file failed, and why, goes with the sample
            meta = {name: value for name, value in sample.items() if name.startswith("__")}
            out = dict(meta)
            for name, value in sample.items():
                if name in meta:
                    continue
                try:
                    out[name] = self.inner({**meta, name: value})[name]
                except SYSTEM_EXCEPTIONS:
                    raise
                except Exception as err:  # noqa: BLE001
                    out[name] = UnreadablePart(name, describe_error(err))
            return out

    def decode(self, fname: str, raw: bytes) -> Any:  # files a cooker reads from auxiliary datasets
        try:
            return self.inner.decode(fname, raw)
        except SYSTEM_EXCEPTIONS:
            raise
        except Exception as err:  # noqa: BLE001
            return UnreadablePart(fname, describe_error(err))

    def config(self) -> dict:
        return self.inner.config()  # the same decoding: the dataset's configuration (and its hash) is unchanged


def _unreadable_in(value: Any, depth: int = 3) -> UnreadablePart | None:
    if isinstance(value, UnreadablePart):
        return value
    if depth == 0 or isinstance(value, (str, bytes)):
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        values = [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        values = list(value.values())
    elif isinstance(value, (list, tuple)):
        values = value
    else:
        return None
    return next((found for v in values if (found := _unreadable_in(v, depth - 1)) is not None), None)


def raise_if_unreadable(sample: Any) -> None:
    """Raise `UnreadableSample` (or `UnsupportedSample`) for a sample that carries a failure from before the
    shuffle buffer."""
    if isinstance(sample, dict) and UNCOOKED in sample:
        reason, why = sample[UNCOOKED]
        raise {UNSUPPORTED: UnsupportedSample, SHARD_UNREADABLE: UnreadableShard}.get(reason, UnreadableSample)(why)
    part = _unreadable_in(sample)
    if part is not None:
        raise UnreadableSample(f"file '{part.name}' cannot be decoded ({part.error})")


def _tombstone_for(sample, err: BaseException):
    """The tombstone of a sample that failed with `err`: too long, unsupported content (a ValueError: what mimo's
    readers raise for content they do not take), or else unreadable."""
    if isinstance(err, TooLong):
        return tombstone(sample, record_of(sample, err.reason, err, needed_tokens=err.needed_tokens))
    if isinstance(err, UnreadableShard):
        return tombstone(sample, record_of(sample, UNREADABLE, err, whole_shard=True))
    if isinstance(err, UnreadableSample) or not isinstance(err, ValueError):
        return tombstone(sample, record_of(sample, UNREADABLE, err))
    return tombstone(sample, record_of(sample, UNSUPPORTED, err))


def _encode_checked(encoder, name: str, sample):
    try:
        raise_if_unreadable(sample)
        return getattr(type(encoder), name)(encoder, sample)
    except (SkipSample, *SYSTEM_EXCEPTIONS):
        raise
    except Exception as err:  # noqa: BLE001 - any failure of one sample is that sample's, counted at consumption
        return _tombstone_for(sample, err)


def _encode_checked_generator(encoder, name: str, sample):
    try:
        raise_if_unreadable(sample)
        yield from getattr(type(encoder), name)(encoder, sample)
    except (SkipSample, *SYSTEM_EXCEPTIONS):
        raise
    except Exception as err:  # noqa: BLE001
        yield _tombstone_for(sample, err)


def _cook_or_defer(encoder, sample, **kwargs):
    if isinstance(sample, dict) and UNCOOKED in sample:  # its raw loading failed already
        return sample
    try:
        return type(encoder).cook_crude_sample(encoder, sample, **kwargs)
    except (SkipSample, *SYSTEM_EXCEPTIONS):
        raise
    except Exception as err:  # noqa: BLE001 - raised again after the shuffle buffer
        part = _unreadable_in(sample)
        if part is not None:
            return {**sample, UNCOOKED: (UNREADABLE, f"file '{part.name}' cannot be decoded ({part.error})")}
        reason = UNSUPPORTED if isinstance(err, ValueError) else UNREADABLE
        return {**sample, UNCOOKED: (reason, f"the crude sample cannot be cooked ({describe_error(err)})")}


def _load_or_defer(factory, load, raw_sample):
    """A dataset's raw-sample loader (its field map) that hands on a sample it cannot load, with why."""
    data = getattr(raw_sample, "data", None)
    raw = data[0] if isinstance(data, tuple) and data and isinstance(data[0], dict) else {}
    if UNCOOKED in raw:  # its shard could not yield it (damaged_shards.py)
        return {**raw, "__subflavors__": getattr(factory, "subflavors", None)}
    try:
        return load(raw_sample)
    except (SkipSample, *SYSTEM_EXCEPTIONS):
        raise
    except Exception as err:  # noqa: BLE001 - raised again after the shuffle buffer
        part = _unreadable_in(raw)
        why = (f"file '{part.name}' cannot be decoded ({part.error})" if part is not None else
               f"a part its dataset's field map names is missing or unreadable ({describe_error(err)}; parts: "
               f"{', '.join(sorted(k for k in raw if not k.startswith('__'))) or 'none'})")
        return {"__key__": raw.get("__key__"), "__restore_key__": raw.get("__restore_key__", ()),
                "__sources__": raw.get("__sources__"), "__subflavors__": getattr(factory, "subflavors", None),
                UNCOOKED: (UNREADABLE, why)}


def defer_dataset_errors(factory) -> None:
    """`factory` (one of energon's loaded datasets) with its raw-sample loader deferring its failures, and its
    shards' damage too: such a sample comes on carrying why (`UNCOOKED`), for the encoder's first step."""
    guard_shard_reads(factory)
    load = getattr(type(factory), "_load_sample_raw", None)
    if load is not None and "_load_sample_raw" not in vars(factory):
        factory._load_sample_raw = functools.partial(_load_or_defer, factory, functools.partial(load, factory))


def _build_deferring(encoder, *, datasets, **kwargs):
    """energon's build_train_datasets, each dataset deferring its failures first (`defer_dataset_errors`)."""
    for loaded in datasets:
        defer_dataset_errors(loaded.dataset)
    return type(encoder).build_train_datasets(encoder, datasets=datasets, **kwargs)


def _method(function, encoder, name: str, original) -> functools.partial:
    method = functools.partial(function, encoder, name) if name else functools.partial(function, encoder)
    for mark in _MARKS:
        if hasattr(original, mark):
            setattr(method, mark, getattr(original, mark))
    return method


def defer_load_errors(task_encoder: TaskEncoder) -> TaskEncoder:
    """A copy of `task_encoder` whose load failures surface after the shuffle buffer (see the module docstring)."""
    encoder = copy.copy(task_encoder)
    if getattr(encoder, "decoder", None) is not None and not isinstance(encoder.decoder, DeferringDecoder):
        encoder.decoder = DeferringDecoder(encoder.decoder)
    cls = type(encoder)
    name = "preencode_sample" if cls.preencode_sample is not TaskEncoder.preencode_sample else "encode_sample"
    original = getattr(cls, name)
    checked = _encode_checked_generator if inspect.isgeneratorfunction(original) else _encode_checked
    setattr(encoder, name, _method(checked, encoder, name, original))
    encoder.cook_crude_sample = _method(_cook_or_defer, encoder, "", cls.cook_crude_sample)
    encoder.build_train_datasets = functools.partial(_build_deferring, encoder)
    return encoder
