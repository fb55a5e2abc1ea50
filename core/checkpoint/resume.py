"""What `--load` means, decided at start-up like Megatron's: a directory with a checkpoint resumes; the `--save`
directory with nothing in it yet starts fresh and says so; any other `--load` without a checkpoint is an error,
so a typo in a resume command never silently restarts a run from iteration 0."""

from __future__ import annotations

from pathlib import Path

from mimo.errors import UsageError

from .layout import COMMON, TRACKER, read_tracker
from ..config import RunConfig


# The checkpoint options of a command that only reads weights (mimo eval, mimo generate): a --config run file's
# save_interval and keep_last would otherwise be refused for want of the save directory dropped with them.
NO_SAVING = {"save": None, "save_interval": None, "keep_last": None}


def check_resume(config: RunConfig, speak: bool = True) -> int | None:
    """The iteration `--load` resumes from, or None for a fresh start; raise UsageError when `--load` is wrong.

    `speak`: whether this process prints the fresh-start line (one process of the run does)."""
    c = config.checkpoint
    if c.load is None:
        return None
    load = Path(c.load)
    if load.exists() and not load.is_dir():
        raise UsageError(f"--load {load} is a file, not a checkpoint directory")
    iteration = read_tracker(load) if load.is_dir() else None  # a corrupted tracker is its own one-line error
    if iteration is not None:
        return iteration
    if c.save is not None and _same(load, Path(c.save)):
        if speak:
            print(f"--load {load} holds no checkpoint yet ({TRACKER} is missing): starting fresh at iteration 0; "
                  f"this run saves there", flush=True)
        return None
    if (load / COMMON).is_file():  # one iter_NNNNNNN folder: --load resumes the save directory's latest
        raise UsageError(f"--load {load} is one checkpoint's folder; --load takes the --save directory that holds it "
                         f"(--load {load.parent} resumes the iteration its {TRACKER} names)")
    where = "no such directory" if not load.exists() else f"no checkpoint there ({TRACKER} is missing)"
    raise UsageError(f"--load {load}: {where}; to start fresh, drop --load or give it the --save directory")


def require_checkpoint(load: Path) -> int:
    """The iteration a `--load` of `mimo eval` or `mimo generate` reads; UsageError naming the folder, what it
    lacks and how a checkpoint is made (checked before anything else: without a checkpoint, nothing else matters)."""
    load = Path(load)
    iteration = read_tracker(load) if load.is_dir() else None
    if iteration is not None:
        return iteration
    where = ("no such directory" if not load.exists() else "a file, not a checkpoint directory" if not load.is_dir()
             else f"no checkpoint there ({TRACKER} is missing)")
    raise UsageError(f"--load {load}: {where}; a checkpoint is what `mimo run --save DIR` writes (`mimo ckpt "
                     f"import-hf HF_DIR DIR` makes one from Hugging Face weights)")


def _same(a: Path, b: Path) -> bool:
    return a.absolute().resolve() == b.absolute().resolve()
