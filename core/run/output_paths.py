"""Every path a run writes, created and test-written at start-up: a path that cannot be written is one line before
any worker starts, not a traceback at the first log line, profile or save."""

from __future__ import annotations

import tempfile
from pathlib import Path

from mimo.errors import UsageError

from ..config import RunConfig


def check_output_paths(config: RunConfig) -> None:
    """Create the run's output directories and the metrics file's folder, and write a probe into each; when one
    is refused, what the others created here is removed again (a refused run leaves nothing behind)."""
    lg, c = config.logging, config.checkpoint
    paths = [(option, Path(path), False) for option, path in (
        ("--tensorboard-dir", lg.tensorboard_dir), ("--profile-dir", lg.profile_dir),
        ("--memory-snapshot-dir", lg.memory_snapshot_dir), ("--save", c.save))
        if path is not None]
    if lg.metrics_file is not None:
        paths.append(("--metrics-file", Path(lg.metrics_file), True))
    created: list[Path] = []  # the outermost folders and files that did not exist before, newest last
    try:
        for option, path, is_file in paths:
            created += [p for p in _missing(path) if p not in created]
            (_appendable_file if is_file else _writable_directory)(option, path)
    except UsageError:
        for path in reversed(created):
            _remove_if_empty(path)
        raise


def check_output_file(option: str, path: Path) -> None:
    """That a command can write its result file `path` when it ends (not after its work, with a traceback): its
    folders are created; the file is not (a refused check removes the folders again)."""
    path = Path(path)
    new = not path.exists()
    created = _missing(path.parent)
    try:
        _appendable_file(option, path)
    except UsageError:
        for made in reversed(created):
            _remove_if_empty(made)
        raise
    finally:
        if new:
            _remove_if_empty(path)


def _missing(path: Path) -> list[Path]:
    """`path` and the folders above it that do not exist yet, outermost first."""
    path = path.absolute()
    missing = [p for p in [path, *path.parents] if not p.exists()]
    return list(reversed(missing))


def _remove_if_empty(path: Path) -> None:
    try:
        if path.is_dir():
            path.rmdir()  # only an empty folder: never what someone else put there meanwhile
        elif path.is_file() and path.stat().st_size == 0:
            path.unlink()
    except OSError:
        pass


def _writable_directory(option: str, path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path} is a file, not a directory")
    _no_file_above(option, path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"{option} {path}: cannot create the directory ({_reason(err)})") from None
    try:  # a probe file: a directory can exist and still refuse files (permissions, a read-only mount, quota)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".mimo-write-test-") as probe:
            probe.write(b"mimo")
            probe.flush()
    except OSError as err:
        raise UsageError(f"{option} {path} is not writable ({_reason(err)})") from None


def _appendable_file(option: str, path: Path) -> None:
    if path.is_dir():
        raise UsageError(f"{option} {path} is a directory, not a file")
    _no_file_above(option, path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"{option} {path}: cannot create its directory {path.parent} ({_reason(err)})") from None
    try:  # the logger appends to it: open it the same way (this creates it, empty, when it is new)
        with path.open("a"):
            pass
    except OSError as err:
        raise UsageError(f"{option} {path} cannot be written ({_reason(err)})") from None


def _no_file_above(option: str, path: Path) -> None:
    """mkdir's own error for a file in the way reads "File exists" or "Not a directory": name the file."""
    for above in path.absolute().parents:
        if above.exists():
            if not above.is_dir():
                raise UsageError(f"{option} {path}: {above} is a file, not a directory")
            return


def _reason(err: OSError) -> str:
    where = f": {err.filename}" if err.filename else ""
    return f"{err.strerror or type(err).__name__}{where}"
