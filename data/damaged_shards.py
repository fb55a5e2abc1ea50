"""A damaged shard: its samples are skipped and counted (named by dataset and shard), never a traceback.

energon reads a sample's files from its tar shard before any map or error handler of its own (the sample loader's
`reader[index]`), so a cut-short tar (`unexpected end of data`) or a damaged tar header ends the worker, and the
run, with a traceback. `guard_shard_reads` wraps each dataset's tar readers: a sample its shard cannot yield
becomes a raw sample without files that carries why (`UNCOOKED`), which `deferred_errors.py` turns into a
tombstone, counted as unreadable where training would have met it, like a sample whose image cannot be decoded.

A shard that cannot be opened at all (missing, unreadable, its first header damaged) would only ever give
skipped samples: its samples carry `SHARD_UNREADABLE`, and the lane stream stops the run with one line naming it
(`shard_stop_line`).

Written against megatron-energon 7.4.1's `WebdatasetSampleLoaderDataset.join_readers` and `ITarReader`
(`tar_filenames`, `tar_filepaths`, `base_path`, `_get_itar_sample_pointer`, `itar_files_cache`).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from megatron.energon.errors import SYSTEM_EXCEPTIONS
from megatron.energon.source_info import SourceInfo

from .skips import UNREADABLE, describe_error

__all__ = ["SHARD_UNREADABLE", "UNCOOKED", "ShardReadGuard", "guard_shard_reads", "shard_stop_line"]

UNCOOKED = "__mimo_uncooked__"  # in a sample that could not be loaded or cooked: (reason, why)
SHARD_UNREADABLE = "shard_unreadable"  # an UNCOOKED reason: the sample's whole shard cannot be opened


class ShardReadGuard:
    """One of energon's tar readers, whose failure to read a sample becomes a sample that carries the failure."""

    def __init__(self, reader):
        self.reader = reader

    def __len__(self) -> int:
        return len(self.reader)

    def __getattr__(self, name: str) -> Any:  # everything else energon asks of the reader
        if name == "reader":  # not set yet (while unpickling)
            raise AttributeError(name)
        return getattr(self.reader, name)

    def __str__(self) -> str:
        return str(self.reader)

    def __getitem__(self, index):
        try:
            return self.reader[index]
        except (*SYSTEM_EXCEPTIONS, KeyboardInterrupt):
            raise
        except Exception as err:  # noqa: BLE001 - the sample's shard is damaged: the sample is skipped, named
            return self._failed(index, err)

    def _failed(self, index, err: BaseException) -> dict:
        reader = self.reader
        try:
            shard_id = reader._get_itar_sample_pointer(index).tar_file_id
            shard, path = reader.tar_filenames[shard_id], reader.tar_filepaths[shard_id]
        except Exception:  # noqa: BLE001 - its index is damaged too: the dataset is named without the shard
            shard_id = shard = path = None
        self._forget(shard_id)  # the open tar may be mid-member: the next sample reopens it
        opened = _open_error(path) if path is not None else None
        if opened is not None:
            uncooked = (SHARD_UNREADABLE, f"the shard cannot be opened ({opened})")
        else:
            uncooked = (UNREADABLE, f"its shard is damaged at this sample ({describe_error(err)})")
        source = SourceInfo(dataset_path=reader.base_path, index=index, shard_name=shard, file_names=())
        return {"__key__": None, "__shard__": shard, "__restore_key__": ("Webdataset", index),
                "__sources__": (source,), UNCOOKED: uncooked}

    def _forget(self, shard_id) -> None:
        cached = getattr(self.reader, "itar_files_cache", {}).pop(shard_id, None)
        if cached is not None:
            try:
                cached.fileobj.close()
                cached.close()
            except Exception:  # noqa: BLE001 - closing a damaged tar may fail again; it is dropped either way
                pass


def _open_error(path) -> str | None:
    """Why the tar at `path` cannot be opened at all, or None when it can."""
    from megatron.energon.flavors.webdataset.itar import ITarFile

    try:
        with path.open(mode="rb") as file, ITarFile.open(fileobj=file, mode="r:"):
            return None
    except (*SYSTEM_EXCEPTIONS, KeyboardInterrupt):
        raise
    except Exception as err:  # noqa: BLE001
        return describe_error(err)


def _build_guarded(factory, build, *args, **kwargs):
    dataset = build(*args, **kwargs)
    inner, seen = dataset, 0
    while inner is not None and seen < 20:  # energon's wrappers hold the dataset they wrap as `.dataset`
        readers = getattr(inner, "join_readers", None)
        if readers is not None:
            inner.join_readers = [r if isinstance(r, ShardReadGuard) else ShardReadGuard(r) for r in readers]
            break
        inner, seen = getattr(inner, "dataset", None), seen + 1
    return dataset


def guard_shard_reads(factory) -> None:
    """Make `factory` (an energon dataset, before it is built) skip the samples its shards cannot yield."""
    build = getattr(type(factory), "build", None)
    if build is not None and "build" not in vars(factory):
        factory.build = functools.partial(_build_guarded, factory, functools.partial(build, factory))


def shard_stop_line(data_path: str, record) -> str:
    """The line a run stops with when a shard cannot be opened at all (`record`: one of its samples' skips)."""
    dataset = record.dataset or "?"
    of = "" if os.path.abspath(dataset) == os.path.abspath(data_path) else f" of dataset {dataset}"
    return (f"--data {data_path}: shard {record.shard or '?'}{of}: {record.error}: restore it from where the "
            f"dataset came from, or move it out of the dataset and run `energon prepare` on the dataset again")
