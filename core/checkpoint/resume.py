"""What `--load` and `--save` mean, decided at start-up like Megatron's, and said aloud: a directory with a checkpoint
resumes; the `--save` directory with nothing in it yet starts fresh and says so; any other `--load` without a
checkpoint is an error, so a typo in a resume command never silently restarts a run from iteration 0. A `--save`
directory holding complete checkpoints this run does not load is refused unless `--start-anew` says to keep them
and save beside them; a save that would land on one of them is refused before the run (save_dir.py)."""

from __future__ import annotations

from pathlib import Path

from mimo.errors import UsageError

from .layout import COMMON, TRACKER, read_tracker
from .save_dir import SaveDirectory, names, survey
from ..config import RunConfig


# The checkpoint options of a command that only reads weights (mimo eval, mimo generate): a --config run file's
# save_interval and keep_last would otherwise be refused for want of the save directory dropped with them.
NO_SAVING = {"save": None, "save_interval": None, "keep_last": None, "start_anew": False}


def check_resume(config: RunConfig, speak: bool = True, train_iters: int | None = None) -> int | None:
    """The iteration `--load` resumes from, or None for a fresh start; raise UsageError when `--load` or `--save`
    is wrong. `train_iters`: the run's last iteration, to check its saves against checkpoints kept in `--save`.

    `speak`: whether this process prints the start-up lines (one process of the run does)."""
    c = config.checkpoint
    saved = survey(Path(c.save)) if c.save is not None else None
    resumes_save = c.load is not None and c.save is not None and _same(Path(c.load), Path(c.save))
    if c.start_anew and resumes_save:
        raise UsageError(f"--start-anew starts without the checkpoints in --save {c.save}, but --load names the same "
                         f"folder: drop --load to start anew there, or --start-anew to resume")
    iteration = _loaded_iteration(config, saved if resumes_save else None, speak)
    if saved is not None:
        _check_save_directory(config, saved, resumes_save and not c.finetune, iteration, train_iters, speak)
    return iteration


def _loaded_iteration(config: RunConfig, saved: SaveDirectory | None, speak: bool) -> int | None:
    """The iteration --load reads (`saved`: the --save directory, when --load names it), or None."""
    c = config.checkpoint
    if c.load is None:
        return None
    load = Path(c.load)
    if load.exists() and not load.is_dir():
        raise UsageError(f"--load {load} is a file, not a checkpoint directory")
    if saved is not None:  # the lock holder moves a lagging tracker up before any worker loads (save_dir.py)
        iteration = saved.resumes
    else:
        iteration = read_tracker(load) if load.is_dir() else None  # a corrupted tracker is its own one-line error
    if iteration is not None:
        return iteration
    if saved is not None:
        if speak:
            print(f"--load {load} holds no checkpoint yet ({TRACKER} is missing): starting fresh at iteration 0; "
                  f"this run saves there", flush=True)
        return None
    if (load / COMMON).is_file():  # one iter_NNNNNNN folder: --load resumes the save directory's latest
        raise UsageError(f"--load {load} is one checkpoint's folder; --load takes the --save directory that holds it "
                         f"(--load {load.parent} resumes the iteration its {TRACKER} names)")
    where = "no such directory" if not load.exists() else f"no checkpoint there ({TRACKER} is missing)"
    raise UsageError(f"--load {load}: {where}; to start fresh, drop --load or give it the --save directory")


def _check_save_directory(config: RunConfig, saved: SaveDirectory, resuming: bool, start: int | None,
                          train_iters: int | None, speak: bool) -> None:
    """Complete checkpoints in --save that this run does not continue are never replaced, pruned or hidden: a run
    that does not load them is refused unless --start-anew, and one whose saves would land on them is refused."""
    c = config.checkpoint
    series = saved.complete.get(saved.resumes) if resuming and saved.resumes is not None else None
    others = saved.others(series, fresh=not resuming)
    if not others:
        return
    root = c.save
    if not resuming and not c.start_anew:
        raise UsageError(f"--save {root} already holds checkpoints ({names(others)}) that this run does not load: "
                         f"add --load {root} to resume them (at iteration {saved.resumes or max(others)}), or "
                         f"--start-anew to start a new run there that keeps them where they are")
    if train_iters is not None:
        interval = c.save_interval or train_iters
        first = (start or 0) if not c.finetune else 0
        scheduled = set(range(first - first % interval + interval, train_iters + 1, interval))
        landing = sorted((scheduled | ({train_iters} if train_iters > first else set())) & set(others))
        if landing:
            raise UsageError(f"--save {root}: this run would save iteration{'s' if len(landing) > 1 else ''} "
                             f"{', '.join(map(str, landing))} where {root} holds another run's complete "
                             f"checkpoint{'s' if len(landing) > 1 else ''} ({names(landing)}), which a run never "
                             f"replaces: give this run another --save folder")
    if speak:
        print(f"note: --save {root} also holds {len(others)} complete checkpoint{'s' if len(others) > 1 else ''} "
              f"of another run ({names(others)}): kept where they are; this run never loads, replaces or prunes "
              f"them", flush=True)


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
