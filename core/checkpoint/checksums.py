"""CRC32 of every shard file of a checkpoint, written with it and checked before it loads.

A shard's tensor bytes carry no check of their own: a file damaged in place (a bad disk, a copy cut and resumed)
would load as wrong weights without a word. Each rank sums the files it wrote (`__<rank>_*.distcp`) right after
writing them; rank 0 keeps the sums in `checksums.json`. At load the ranks share the files to check, and all stop
on the first mismatch with one line. A checkpoint without the file (older mimo) loads as before."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch.distributed as dist

from mimo.errors import UsageError

NAME = "checksums.json"


def crc32(path: Path) -> str:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def gather(directory: Path) -> dict[str, str] | None:
    """Collective: every rank sums its own shard files; rank 0 gets them all (None elsewhere)."""
    own = {p.name: crc32(p) for p in sorted(Path(directory).glob(f"__{dist.get_rank()}_*.distcp"))}
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(own, everyone, dst=0)
    return {name: value for part in everyone for name, value in part.items()} if everyone else None


def write(directory: Path, sums: dict[str, str], atomic_write) -> None:
    atomic_write(Path(directory) / NAME, lambda f: f.write(json.dumps(sums, indent=0, sort_keys=True).encode()))


def verify(directory: Path) -> None:
    """Collective: the ranks check the listed files between them; every rank raises the first mismatch. Without
    a process group (export-hf), this process checks them all."""
    alone = not dist.is_initialized()
    path = Path(directory) / NAME
    problem = None
    if path.is_file():
        try:
            sums = json.loads(path.read_text())
        except ValueError:
            sums, problem = {}, f"checkpoint file {path} cannot be read (not JSON)"
        rank, size = (0, 1) if alone else (dist.get_rank(), dist.get_world_size())
        for name in sorted(sums)[rank::size]:
            if problem is None and (directory / name).is_file() and crc32(directory / name) != sums[name]:
                problem = f"checkpoint file {directory / name} is damaged (its CRC32 differs from the one saved)"
    problems = [problem]
    if not alone:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first:
        raise UsageError(first)
