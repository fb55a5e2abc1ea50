"""A sample that fails to load is dropped where training would have met it, not where the shuffle buffer read it.

energon decodes a sample's files (and cooks a crude sample) before its shuffle buffer. An error there drops the
sample while the buffer reads ahead, up to `shuffle_buffer_size` samples before training would have reached it,
and the buffer then holds other samples than it would have. `defer_load_errors` gives the lane loader a copy of
the task encoder in which such a failure travels with the sample instead:

* its decoder (`DeferringDecoder`, the task encoder's `decoder`, which energon hands to the dataset) puts an
  `UnreadablePart` in place of a file that cannot be decoded;
* its `cook_crude_sample` hands on a crude sample it could not cook, with the error attached (`UNCOOKED`);
* its first step after the buffer (`encode_sample`, or `preencode_sample` where the encoder has one) raises
  `UnreadableSample` for such a sample, and energon's error handler drops it.

So the bad sample takes its slot in the shuffle buffer like any other, energon drops it at the very position of the
stream where training would have consumed it, and the good samples come in the order a dataset without the bad
samples' errors would give them. Errors in energon's own field mapping (e.g. a sample without the file the
dataset's field map names) still happen before the buffer.

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

from .skips import UnreadableSample, describe_error, encoding_sample

__all__ = ["DeferringDecoder", "UNCOOKED", "UnreadablePart", "UnreadableSample", "defer_load_errors",
           "raise_if_unreadable"]

UNCOOKED = "__mimo_uncooked__"  # in a crude sample the cooker failed on: why
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
    """Raise `UnreadableSample` for a sample that carries a failure from before the shuffle buffer."""
    if isinstance(sample, dict) and UNCOOKED in sample:
        raise UnreadableSample(sample[UNCOOKED])
    part = _unreadable_in(sample)
    if part is not None:
        raise UnreadableSample(f"file '{part.name}' cannot be decoded ({part.error})")


def _encode_checked(encoder, name: str, sample):
    raise_if_unreadable(sample)
    with encoding_sample(sample):  # the encoder's own skips (too long) then name the sample's shard
        return getattr(type(encoder), name)(encoder, sample)


def _encode_checked_generator(encoder, name: str, sample):
    raise_if_unreadable(sample)
    yield from getattr(type(encoder), name)(encoder, sample)


def _cook_or_defer(encoder, sample, **kwargs):
    try:
        return type(encoder).cook_crude_sample(encoder, sample, **kwargs)
    except (SkipSample, *SYSTEM_EXCEPTIONS):
        raise
    except Exception as err:  # noqa: BLE001 - raised again after the shuffle buffer
        part = _unreadable_in(sample)
        why = (f"file '{part.name}' cannot be decoded ({part.error})" if part is not None
               else f"the crude sample cannot be cooked ({describe_error(err)})")
        return {**sample, UNCOOKED: why}


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
    return encoder
