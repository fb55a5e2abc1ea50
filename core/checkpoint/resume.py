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
    if speak:
        _warn_replacing(config)
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


def _warn_replacing(config: RunConfig) -> None:
    """One line when `--save` already holds checkpoints that this run does not `--load`: it starts over and its
    saves replace them (`--keep-last` deletes the rest), which a resume command missing `--load` does silently."""
    c = config.checkpoint
    if c.save is None or (c.load is not None and _same(Path(c.load), Path(c.save))):
        return
    try:
        iteration = read_tracker(Path(c.save))
    except UsageError:  # a corrupted tracker: this run's first save replaces it
        return
    if iteration is not None:
        pruned = ", and --keep-last deletes the older ones" if c.keep_last else ""
        print(f"warning: --save {c.save} already holds checkpoints (up to iteration {iteration}) that this run does "
              f"not load: its saves replace them{pruned}; to resume them, add --load {c.save}", flush=True)


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
