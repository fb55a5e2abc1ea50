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


def lock_save_directory(save: Path) -> None:
    path = Path(save) / LOCK
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise UsageError(f"--save {save} is in use by another run ({holder} holds {path}): give this run its own "
                         f"--save, or wait for that run to end") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    _held.append(handle)


def release_all() -> None:
    while _held:
        _held.pop().close()
