"""What a `--save` directory holds, and the only changes a run makes to checkpoints it did not just write.

Every checkpoint belongs to a series: the run that began it and every resume of it (`series` in common.pt; None
for checkpoints of an older mimo, which count as one series). A checkpoint is complete when its common.pt exists:
the save writes it last, after every rank's shards, checksums.json and run.yaml. From that record alone:

- the lock holder removes at start-up only `iter_*` folders without common.pt (saves cut short) and stray
  temporary files (`remove_unfinished`);
- a complete checkpoint newer than the tracker is never removed: of the tracker's own series (a save killed after
  common.pt, before the tracker moved) the tracker moves up to it; of another series it is named;
- `--keep-last` deletes only complete checkpoints of the run's own series, older than the one just saved;
- a save never writes into a complete checkpoint's folder (checkpointer.py).

Reading needs no process group (`survey`): `mimo ckpt inspect`, the start-up checks and the lock holder use it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from mimo.errors import UsageError

from .layout import COMMON, TRACKER, atomic_write, iteration_dir, read_common, read_tracker


@dataclass
class SaveDirectory:
    """One `--save` directory as it is on disk."""
    root: Path
    tracker: int | None  # the iteration the tracker names (None: no tracker)
    complete: dict[int, str | None] = field(default_factory=dict)  # iteration -> its series
    unfinished: list[Path] = field(default_factory=list)  # iter_* folders without common.pt

    @property
    def tracker_series(self) -> str | None:
        return self.complete.get(self.tracker) if self.tracker is not None else None

    @property
    def resumes(self) -> int | None:
        """The iteration a resume loads: the tracker's, moved up over newer complete checkpoints of its own series
        (a save killed after its common.pt, before the tracker moved); without a tracker, the newest complete one
        when all of them are of one series."""
        if self.tracker is None:
            return max(self.complete) if len(set(self.complete.values())) == 1 else None
        if self.tracker not in self.complete:
            return self.tracker  # a tracker naming a folder that is gone: the load says so in one line
        return max(it for it, series in self.complete.items()
                   if it == self.tracker or (it > self.tracker and series == self.tracker_series))

    def others(self, series: str | None, *, fresh: bool) -> list[int]:
        """Complete checkpoints that belong to another run than one of `series` (`fresh`: a run that loads none of
        this directory's, so all of them)."""
        return sorted(it for it, s in self.complete.items() if fresh or s != series)

    def newer_than_resumed(self) -> list[int]:
        """Complete checkpoints newer than the one a resume loads (of other series: never loaded, never removed)."""
        resumed = self.resumes
        return sorted(it for it in self.complete if resumed is not None and it > resumed)


def survey(root: Path) -> SaveDirectory:
    """Read `root` without changing anything (common.pt of each complete checkpoint for its series)."""
    root = Path(root)
    found = SaveDirectory(root, read_tracker(root) if root.is_dir() else None)
    for path in sorted(root.glob("iter_*")) if root.is_dir() else ():
        if not (path.is_dir() and len(path.name) == 12 and path.name[5:].isdigit()):
            continue
        if (path / COMMON).is_file():
            found.complete[int(path.name[5:])] = series_of(path)
        else:
            found.unfinished.append(path)
    return found


def series_of(directory: Path) -> str | None:
    """The series a complete checkpoint belongs to; an unreadable common.pt stands for a series of its own."""
    try:
        return read_common(directory).get("series")
    except UsageError:
        return f"unreadable:{directory.name}"


def names(iterations: list[int], limit: int = 4) -> str:
    shown = ", ".join(iteration_dir(Path(), it).name for it in iterations[:limit])
    return shown + (f" and {len(iterations) - limit} more" if len(iterations) > limit else "")


def remove_unfinished(root: Path) -> list[str]:
    """What the save lock's holder does at start-up: remove the folders of saves cut short (no common.pt) and
    stray temporary files, move the tracker up over complete checkpoints of its own series that a kill left
    uncommitted, and name complete checkpoints of other series newer than it. Returns the lines that say so."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = survey(root)
    lines = []
    for path in found.unfinished:
        shutil.rmtree(path, ignore_errors=True)
    for stray in root.glob("*.tmp"):
        stray.unlink(missing_ok=True)
    if found.unfinished:
        removed = [int(p.name[5:]) for p in found.unfinished]
        count = f"{len(removed)} unfinished checkpoint{'s' if len(removed) > 1 else ''}"
        lines.append(f"removed {count} in {root} ({names(removed)}: saves cut short before their common.pt was "
                     f"written; complete checkpoints are never removed)")
    resumes = found.resumes
    if resumes is not None and resumes != found.tracker:
        atomic_write(root / TRACKER, lambda f: f.write(f"{resumes}\n".encode()))
        was = f"iteration {found.tracker}" if found.tracker is not None else "no iteration"
        lines.append(f"{root}: the tracker named {was}, but {iteration_dir(root, resumes).name} is complete (a save "
                     f"stopped before the tracker moved): the tracker now names iteration {resumes}")
    return lines


def prune(root: Path, keep_last: int, series: str | None, saved: int) -> list[int]:
    """`--keep-last`: delete all but the newest `keep_last` complete checkpoints of `series` up to `saved` (the
    one just committed, which the tracker names). Another series' checkpoints and newer ones are never touched.
    Returns the iterations deleted."""
    found = survey(root)
    ours = sorted(it for it, s in found.complete.items() if s == series and it <= saved)
    deleted = [it for it in ours[:-keep_last] if it != saved]
    for iteration in deleted:
        directory = iteration_dir(root, iteration)
        (directory / COMMON).unlink()  # first the completion record: a kill midway leaves an unfinished folder
        shutil.rmtree(directory, ignore_errors=True)
    return deleted
