"""A folder that appears whole or not at all: written as `.OUT.mimo-partial-<pid>` beside OUT (locked while its
writer lives), then renamed to OUT. A writer killed halfway leaves only the partial folder, which the next writer
into OUT removes with one line (its lock is free once its writer is dead, even after SIGKILL).

    with writing(out, what="import", unfinished=looks_unfinished) as folder:
        ...write into folder...

OUT must not exist or be empty; a folder `unfinished(OUT)` recognises (left by an older mimo that wrote in place)
is removed and written again, with one line; any other non-empty OUT is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path

from mimo.errors import UsageError

__all__ = ["PARTIAL", "remove_stale_partials", "writing"]

PARTIAL = ".mimo-partial-"
_LOCK = ".mimo-lock"


def _partials(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}{PARTIAL}*")) if out.parent.is_dir() else []


def remove_stale_partials(out: Path, what: str) -> None:
    """Remove partial folders of OUT whose writer is gone (their lock can be taken), one line each."""
    for partial in _partials(out):
        try:
            with open(partial / _LOCK, "a+") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live writer holds it (or it cannot be opened: left alone)
        shutil.rmtree(partial, ignore_errors=True)
        print(f"removed {partial}: an {what} that did not finish", flush=True)


@contextlib.contextmanager
def writing(out, what: str, unfinished=lambda out: False):
    """Yield a locked partial folder; rename it to `out` when the block ends without an error."""
    out = Path(out)
    remove_stale_partials(out, what)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} is a file: {what} into a new folder")
    if out.is_dir() and any(out.iterdir()):
        why = unfinished(out)
        if not why:
            raise UsageError(f"{out} is not empty (it holds other files): {what} into a new folder")
        print(f"{out} holds an unfinished {what} ({why}): doing it again", flush=True)
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}{PARTIAL}{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    handle = open(partial / _LOCK, "a+")
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        yield partial
        (partial / _LOCK).unlink()
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        handle.close()
