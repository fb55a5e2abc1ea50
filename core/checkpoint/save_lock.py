"""One run per save directory: the process that speaks for a run holds an exclusive lock on `<save>/.mimo-lock`
until it exits, so a second run pointed at the same `--save` is refused at start-up instead of interleaving its
checkpoints and tracker with the first's. The kernel drops the lock when its holder dies, even by SIGKILL."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from mimo.errors import UsageError

LOCK = ".mimo-lock"
_held: list = []  # open lock files: kept for the life of the process


def check_not_in_use(save: Path) -> None:
    """Refuse a --save that a live run holds, before reading what it holds (its saves may be under way), writing
    nothing: a shared lock, dropped at once, conflicts with the holder's exclusive one."""
    path = Path(save) / LOCK
    if path.is_file():
        with open(path) as handle:
            _take(handle, fcntl.LOCK_SH, save, path)


def lock_save_directory(save: Path) -> None:
    path = Path(save) / LOCK
    handle = open(path, "a+")
    _take(handle, fcntl.LOCK_EX, save, path)
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    _held.append(handle)


def _take(handle, kind: int, save: Path, path: Path) -> None:
    try:
        fcntl.flock(handle, kind | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise UsageError(f"--save {save} is in use by another run ({holder} holds {path}): give this run its own "
                         f"--save, or wait for that run to end") from None


def release_all() -> None:
    while _held:
        _held.pop().close()
