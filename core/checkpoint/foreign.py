"""What `--pretrained DIR` points at, and loading the checkpoint formats providers read themselves.

A mimo checkpoint (its tracker names an iteration whose common.pt describes a mimo run) loads through the
Checkpointer; a Hugging Face folder is converted before the workers start (hf.py); any other megatron-core
dist checkpoint (a save directory with a tracker, as Megatron-LM writes, or the iteration directory itself) goes
to the provider's `load_pretrained` hook, which knows its key names.
"""

from __future__ import annotations

from pathlib import Path

from mimo.errors import UsageError

from .layout import COMMON, TRACKER, iteration_dir, read_common, read_tracker

DIST_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a dist checkpoint


def foreign_directory(path: Path) -> Path | None:
    """The dist-checkpoint directory of a checkpoint that mimo did not write, or None for a mimo checkpoint."""
    path = Path(path)
    iteration = read_tracker(path)
    directory = iteration_dir(path, iteration) if iteration is not None else path
    if not (directory / DIST_METADATA).is_file():
        if iteration is None:
            raise UsageError(f"--pretrained {path}: no checkpoint there (neither a {TRACKER}, a Hugging Face "
                             f"config.json with safetensors, nor a dist checkpoint's {DIST_METADATA})")
        return None  # a mimo checkpoint missing files: the Checkpointer names what is missing
    if (directory / COMMON).is_file() and "run" in _common(directory):  # mimo's own (common.pt read once)
        if iteration is not None:
            return None
        # one iter_NNNNNNN folder: no provider reads mimo's own checkpoint as foreign
        raise UsageError(f"--pretrained {path} is one checkpoint's folder of a mimo run; give the --save directory "
                         f"that holds it (--pretrained {path.parent} loads the iteration its {TRACKER} names)")
    return directory


def _common(directory: Path) -> dict:
    try:  # another framework's common.pt may hold objects this environment cannot unpickle: not mimo's either
        common = read_common(directory)
    except UsageError:
        return {}
    return common if isinstance(common, dict) else {}


def load_foreign(hooks, settings, model, path: Path, directory: Path) -> None:
    """The provider's `load_pretrained` reads `directory`; a format no provider reads is one line."""
    try:
        read = hooks.load_pretrained(settings=settings, model=model, directory=directory)
    except UsageError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever a library raises while reading is one line for the user
        first = (str(err).strip().splitlines() or [""])[0]
        raise UsageError(f"--pretrained {path} cannot be loaded ({type(err).__name__}: {first[:400]})") from None
    if not read:
        raise UsageError(f"--pretrained {path} is not a mimo checkpoint and the provider reads no checkpoint format "
                         f"of its own there (mimo ckpt import-hf converts Hugging Face folders)")
