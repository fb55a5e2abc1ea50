"""Hugging Face model folders, read slice by slice and written shard by shard, holding no more than one bounded
buffer beyond what the caller asked for.

A folder holds either one `model.safetensors`, or shards listed in `model.safetensors.index.json`
(`{"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file}}`), next to `config.json`. A
safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte offsets) and
the tensors' bytes, row-major.

`FolderSource` parses the headers and reads with `os.preadv` exactly the bytes of a requested hyper-rectangle,
straight into the caller's tensor when dtype and device agree, else through one buffer of at most `chunk_bytes`.
It maps nothing: a memory map keeps every page it touched in the process's resident memory (safetensors'
`safe_open`), and safetensors' own pread backend reads a whole tensor for any slice. `ShardWriter` writes shards
whose headers are planned from names, dtypes and shapes alone, then each tensor's bytes as they come.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from mimo.errors import UsageError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size
CHUNK_BYTES = 64 * 2**20  # the read buffer for casts, devices and column slices
SMALL_RUN = 2**20  # contiguous runs shorter than this are read as blocks of whole rows

DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
CODES = {dtype: code for code, dtype in DTYPES.items()}


def read_config(folder: str | Path) -> dict:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise UsageError(f"{folder} has no {CONFIG_FILE}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UsageError(f"{path} is not JSON ({err})") from None


def is_hf_folder(path: str | Path | None) -> bool:
    """config.json with `model.safetensors` or the shards' index."""
    path = Path(path) if path else None
    return bool(path) and (path / CONFIG_FILE).is_file() and (
        (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file())


def read_header(path: Path) -> tuple[int, dict]:
    """(offset of the data, {name: {"dtype", "shape", "data_offsets"}}) of one safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UsageError(f"{path} is not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UsageError(f"{path} is not a safetensors file (its header is not JSON)") from None
    header.pop("__metadata__", None)
    return 8 + length, header


class Meter:
    """What a source read: bytes delivered to callers, bytes read from disk (a column slice reads whole rows), the
    number of reads, the largest one, and the tensors read whole."""

    def __init__(self):
        self.bytes = self.disk = self.calls = self.largest = 0
        self.whole: list[str] = []


class _Entry:
    __slots__ = ("file", "start", "dtype", "shape")

    def __init__(self, file: str, start: int, dtype: torch.dtype, shape):
        self.file, self.start, self.dtype, self.shape = file, start, dtype, tuple(shape)


class FolderSource:
    """A Hugging Face folder's tensors by name: shapes and dtypes from the headers, hyper-rectangles read on
    request. Close it (or use it as a context manager) to release the file descriptors."""

    def __init__(self, folder: str | Path, chunk_bytes: int = CHUNK_BYTES):
        self.folder, self.chunk = Path(folder), chunk_bytes
        self.meter = Meter()
        if (self.folder / INDEX_FILE).is_file():
            files = sorted(set(json.loads((self.folder / INDEX_FILE).read_text())["weight_map"].values()))
        elif (self.folder / SINGLE_FILE).is_file():
            files = [SINGLE_FILE]
        else:
            raise UsageError(f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        self.entries: dict[str, _Entry] = {}
        for file in files:
            if not (self.folder / file).is_file():
                raise UsageError(f"{self.folder / file} is missing (named in {INDEX_FILE})")
            base, header = read_header(self.folder / file)
            for name, info in header.items():
                if info["dtype"] not in DTYPES:
                    raise UsageError(f"{self.folder / file}: tensor {name} has dtype {info['dtype']}, which mimo "
                                     f"does not read")
                self.entries[name] = _Entry(file, base + info["data_offsets"][0], DTYPES[info["dtype"]],
                                            info["shape"])
        self._fds: dict[str, int] = {}

    def names(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple:
        if name not in self.entries:
            raise UsageError(f"{self.folder} has no tensor {name}")
        return self.entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name].dtype

    def read(self, name: str, index=None) -> torch.Tensor:
        """A new tensor of `name` (all of it, or `index`)."""
        entry = self.entries[name]
        index = index or tuple((0, n) for n in entry.shape)
        out = torch.empty([b - a for a, b in index], dtype=entry.dtype)
        self.read_into(name, index, out)
        return out

    def read_into(self, name: str, index, out: torch.Tensor) -> None:
        """out[...] = tensor[index], index one (start, stop) per dim; `out` has the index's shape, any dtype and
        device (cast on copy). Reads contiguous runs: the trailing dims a run covers whole."""
        self.shape(name)  # an unknown name is one line
        e = self.entries[name]
        shape, item = e.shape, e.dtype.itemsize
        want = tuple(b - a for a, b in index)
        if len(index) != len(shape) or tuple(out.shape) != want:
            raise ValueError(f"{name}: index {index} of shape {shape} into {tuple(out.shape)}")
        if not out.is_contiguous():  # never for Nemotron / RADIO: at most this destination's size
            staging = torch.empty(want, dtype=e.dtype)
            self.read_into(name, index, staging)
            out.copy_(staging)
            return
        numel = math.prod(want)
        if numel == 0:
            return
        self.meter.bytes += numel * item
        if all(ix == (0, n) for ix, n in zip(index, shape)):
            self.meter.whole.append(name)
        if not shape:  # a scalar
            self._read(e, 0, 1, out.view(-1), 0)
            return
        partial = max((d for d, (ix, n) in enumerate(zip(index, shape)) if ix != (0, n)), default=0)
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        a, b = index[partial]
        run = (b - a) * strides[partial]  # elements in one contiguous run
        flat = out.view(-1)
        if partial == 1 and len(shape) == 2 and run * item < SMALL_RUN:
            self._column_slice(e, index, shape, flat)
            return
        outer = [range(lo, hi) for lo, hi in index[:partial]]
        for i, position in enumerate(_positions(outer)):
            offset = sum(p * strides[d] for d, p in enumerate(position)) + a * strides[partial]
            self._read(e, offset, run, flat, i * run)

    def _column_slice(self, e: _Entry, index, shape, flat: torch.Tensor) -> None:
        """Columns of a 2-D tensor (a row-parallel weight's TP slice): whole rows in blocks of at most a chunk,
        the columns copied out: sequential reads through one bounded buffer."""
        (r0, r1), (c0, c1) = index
        row_bytes = shape[1] * e.dtype.itemsize
        per = max(self.chunk // row_bytes, 1)
        out = flat.view(r1 - r0, c1 - c0)
        for start in range(r0, r1, per):
            rows = min(per, r1 - start)
            block = torch.empty(rows, shape[1], dtype=e.dtype)
            self._pread(e, start * shape[1], block.view(-1))
            out[start - r0:start - r0 + rows].copy_(block[:, c0:c1])

    def _read(self, e: _Entry, offset: int, count: int, flat: torch.Tensor, at: int) -> None:
        """`count` elements from element `offset` of the tensor into flat[at:at + count]: straight in when dtype
        and device agree, else through the chunk buffer."""
        target = flat[at:at + count]
        if target.dtype == e.dtype and target.device.type == "cpu":
            self._pread(e, offset, target)
            return
        step = max(self.chunk // e.dtype.itemsize, 1)
        for s in range(0, count, step):
            buffer = torch.empty(min(step, count - s), dtype=e.dtype)
            self._pread(e, offset + s, buffer)
            target[s:s + buffer.numel()].copy_(buffer)

    def _pread(self, e: _Entry, offset: int, target: torch.Tensor) -> None:
        nbytes = target.numel() * e.dtype.itemsize
        if e.file not in self._fds:
            self._fds[e.file] = os.open(self.folder / e.file, os.O_RDONLY)
        view = memoryview(target.view(torch.uint8).numpy()) if nbytes else b""
        position, done = e.start + offset * e.dtype.itemsize, 0
        while done < nbytes:  # preadv may return short reads (large requests, signals)
            got = os.preadv(self._fds[e.file], [view[done:]], position + done)
            if got <= 0:
                raise UsageError(f"{self.folder / e.file} is truncated (reading {nbytes} bytes at {position})")
            done += got
        self.meter.disk += nbytes
        self.meter.calls += 1
        self.meter.largest = max(self.meter.largest, nbytes)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _positions(ranges):
    if not ranges:
        yield ()
        return
    for first in ranges[0]:
        for rest in _positions(ranges[1:]):
            yield (first,) + rest


class TensorsSource:
    """Tensors in memory behind FolderSource's reading interface (tests, the contract kit's round trip)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors, self.meter = dict(tensors), Meter()

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple:
        if name not in self.tensors:
            raise UsageError(f"the tensors have no {name}")
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def read(self, name: str, index=None) -> torch.Tensor:
        return self.tensors[name][tuple(slice(a, b) for a, b in index or ())].clone()

    def read_into(self, name: str, index, out: torch.Tensor) -> None:
        out.copy_(self.tensors[name][tuple(slice(a, b) for a, b in index)])
        self.meter.bytes += out.numel() * self.tensors[name].element_size()

    def close(self) -> None:
        pass


# -------------------------------------------------------------------------------------------------- writing


class ShardWriter:
    """Safetensors shards of at most `max_bytes` (a larger tensor gets one of its own) from a plan of (name,
    dtype, shape), tensor by tensor in the plan's order: each shard's header first (the offsets follow from the
    shapes), then the tensors' bytes as `write` gets them. `finish` writes the index when there are several."""

    def __init__(self, folder: str | Path, plan: list[tuple[str, torch.dtype, tuple]],
                 max_bytes: int = DEFAULT_SHARD_BYTES):
        self.folder = Path(folder)
        shards, size = [[]], 0
        for name, dtype, shape in plan:
            nbytes = math.prod(shape) * dtype.itemsize
            if shards[-1] and size + nbytes > max_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, dtype, tuple(shape), nbytes))
            size += nbytes
        self.shards = shards
        self.files = [SINGLE_FILE] if len(shards) == 1 else \
            [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
        self.order = [entry[0] for shard in shards for entry in shard]
        self._where = {entry[0]: (i, entry) for i, shard in enumerate(shards) for entry in shard}
        self._next, self._file, self._shard = 0, None, -1

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name != self.order[self._next]:
            raise ValueError(f"ShardWriter: {self.order[self._next]} comes next, not {name}")
        i, (_, dtype, shape, _) = self._where[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"ShardWriter: {name} planned as {dtype} {shape}, got {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
        if i != self._shard:
            self._open(i)
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            self._file.write(memoryview(data.view(torch.uint8).reshape(-1).numpy()))
        self._next += 1
        if self._next == len(self.order) or self._where[self.order[self._next]][0] != i:
            self._file.close()
            self._file = None

    def _open(self, i: int) -> None:
        header, offset = {"__metadata__": {"format": "pt"}}, 0  # "pt": what transformers checks for
        for name, dtype, shape, nbytes in self.shards[i]:
            header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # 8-byte aligned data, as safetensors writes it
        self._file = open(self.folder / self.files[i], "wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self._shard = i

    def finish(self) -> None:
        if self._next != len(self.order):
            raise ValueError(f"ShardWriter: {len(self.order) - self._next} tensors were not written")
        if len(self.files) > 1:
            index = {"metadata": {"total_size": sum(e[3] for shard in self.shards for e in shard)},
                     "weight_map": {name: self.files[i] for name, (i, _) in self._where.items()}}
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def save(folder: str | Path, tensors: Mapping[str, torch.Tensor], config: dict,
         max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write `tensors` (in their order) as a model folder with `config` as config.json. The folder may exist but
    must not hold a checkpoint already: stale shards next to new ones would be read as one model."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in folder.glob("*.safetensors")) + [n for n in (INDEX_FILE,) if (folder / n).exists()]
    if stale:
        raise UsageError(f"{folder} already holds a checkpoint ({', '.join(stale)}); write to an empty folder")
    writer = ShardWriter(folder, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], max_shard_bytes)
    for name in writer.order:
        writer.write(name, tensors[name])
    writer.finish()
    write_json(folder / CONFIG_FILE, config)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def readable_by_all(folder: str | Path) -> None:
    """Give `folder` and everything in it the modes `mkdir` and a plain `open` give under the process's umask
    (0755 and 0644 under 022): temporary directories and some writers (safetensors' save_file) use 0700 / 0600."""
    umask = _umask()
    os.chmod(folder, 0o777 & ~umask)  # a temporary directory is created 0700
    for path in Path(folder).rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
