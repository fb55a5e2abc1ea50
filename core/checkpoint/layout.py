"""A checkpoint on disk, in Megatron's layout, and what it records about the run that saved it:

    <dir>/latest_checkpointed_iteration.txt      the tracker: the newest complete checkpoint
    <dir>/iter_0000010/                          metadata.json, .metadata, *.distcp shards, common.pt

Files are replaced atomically (a temporary file, fsync, rename), so a kill at any moment leaves the tracker
naming a complete checkpoint. Reading these files needs no process group (`mimo ckpt inspect`, `--load` checks).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
from pathlib import Path

import torch

from mimo.errors import UsageError

from .. import run_file

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
RUN_FILE = "run.yaml"  # the effective configuration of the run that saved it (core/run_file.py)
VERSION = 1


def fault_point(stage: str, iteration: int) -> None:
    """Crash-safety tests kill a saving process at named stages: MIMO_FAULT_KILL_AT=<stage>@<iteration>."""
    if os.environ.get("MIMO_FAULT_KILL_AT") == f"{stage}@{iteration}":
        os.kill(os.getpid(), signal.SIGKILL)


def iteration_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def read_tracker(root: Path) -> int | None:
    """The iteration the tracker names; None when `root` holds no checkpoint yet."""
    tracker = Path(root) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise UsageError(f"checkpoint tracker {tracker} is corrupted (holds {text[:40]!r}, not an iteration)")
    return int(text)


def read_common(directory: Path) -> dict:
    """The run-level state of one checkpoint (rank 0 wrote it); a clear error when missing or unreadable."""
    path = Path(directory) / COMMON
    if not path.is_file():
        raise UsageError(f"checkpoint {directory} is incomplete: {path} is missing")
    try:  # plain data only, so reading it runs no code (megatron-core unpickles it: docs/checkpoints.md)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same problem for the user
        raise UsageError(f"checkpoint file {path} cannot be read ({type(err).__name__}: {first_words(err)})") \
            from None


def first_words(err: Exception, limit: int = 300) -> str:
    """An exception's gist for a one-line error: torch's weights-only refusal by its reason (its preamble offers
    options mimo does not take), else the first line; no terminal escapes; shortened at a word boundary."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(err).strip().splitlines()]
    reasons = [line.partition(":")[2].strip() for line in lines if line.startswith("WeightsUnpickler error:")]
    first = reasons[0] if reasons else next((line for line in lines if line), "")
    if len(first) <= limit:
        return first
    return first[:limit].rsplit(" ", 1)[0].rstrip(" ,;:") + " ..."


def report_io(verb: str, directory: Path, seconds: float, blocked: float | None = None) -> None:
    """One line per save or load; an async save also says how long training waited for it."""
    size = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
    waited = f", training blocked {blocked:.2f} s" if blocked is not None else ""
    print(f"{verb} checkpoint {directory} in {seconds:.2f} s ({size / 2**30:.3f} GiB, "
          f"{size / 2**30 / max(seconds, 1e-9):.2f} GiB/s{waited})", flush=True)


def atomic_write(path: Path, write) -> None:
    """Write to a temporary file, flush it to disk, then rename over `path` (atomic on POSIX)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def run_info(plan, settings, lane_data_state: bool) -> dict:
    """What a checkpoint records about the run that saved it (shown by `mimo ckpt inspect`)."""
    def plain(value):
        if dataclasses.is_dataclass(value):
            return {k: plain(v) for k, v in dataclasses.asdict(value).items()}
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return str(value) if isinstance(value, Path) else value

    return {
        "provider": plan.config.provider,
        "options": plain(plan.config),
        "settings": plain(settings),
        "layout": {name: {**plain(p), "dp": p.dp} for name, p in plan.parallelism.items()},
        "world_size": plan.world_size,
        "parameters": {name: s.num_parameters for name, s in plan.shapes.items()},
        # Whether each lane's data iterator has a state of its own (then it cannot move to another layout).
        "lane_data_state": lane_data_state,
        "run_file": run_file.dump(plan.config, settings),  # written beside common.pt as RUN_FILE
    }
