"""Checkpoints of a LoRA run (--lora-rank): the adapters alone, with the base they were trained on named by path,
iteration and fingerprint. A resume, `mimo eval`, `mimo generate`, `merge-lora` and `export-hf` load that base
(the recorded folders, checked again, where no --pretrained is given; or the seeded initialization it was trained
on) and then the adapters; a base that is gone or changed since is refused in one line, not silently adapted.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from mimo.errors import UsageError

from ..adapters.apply import is_adapter_name
from ..config import CheckpointOptions
from . import checksums

BASE = "base"
ADAPTERS = "adapters"
BASE_OPTIONS = ("pretrained", "pretrained_llm", "pretrained_vision")  # the options that name a base


def model_part(state: dict, part: str | None) -> dict:
    """The sharded model state of `part`: the adapters' tensors, the base's (every other), or all (None)."""
    if part is None:
        return state
    keep = part == ADAPTERS
    return {key: value for key, value in state.items() if is_adapter_name(key) == keep}


FINGERPRINT = 2  # how `checksum` reads a folder; records without the field were taken by version 1
_WHOLE_BELOW = 1 << 20  # files smaller than this are read whole (configs, tokenizers, common.pt)
_SAMPLES, _BLOCK = 8, 1 << 16  # larger ones: this many blocks spread over the data


def checksum(path: Path, version: int = FINGERPRINT) -> str:
    """A fingerprint of a weights folder, cheap for any size (no full read of tens of GB): every file's name and
    size; small files whole; the shard CRC32s a mimo checkpoint records (checksums.json); a safetensors file's
    header (its tensors' names, shapes and offsets) and, from version 2, blocks of every large file's data spread
    over it (new weights of the same shapes rewrite them: a fine-tuned export into the same folder is told apart).
    `version` 1: names, sizes, checksums.json and headers, as records without a version were taken."""
    digest = hashlib.sha256()
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    if version > 1 and root.is_dir():  # not a download tool's bookkeeping (`.cache/huggingface/`): it may change
        files = [p for p in files if not any(part.startswith(".") for part in p.relative_to(root).parts[:-1])]
    summed = any(f.name == checksums.NAME for f in files)  # its CRC32s cover the shards' bytes
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(root) if root.is_dir() else file.name}:{size}\n".encode())
        if file.name == checksums.NAME or (version > 1 and size < _WHOLE_BELOW):
            digest.update(file.read_bytes())
            continue
        sampled = version > 1 and not (summed and file.suffix == ".distcp")
        if not sampled and file.suffix != ".safetensors":
            continue
        start = 0
        with open(file, "rb") as f:
            if file.suffix == ".safetensors":
                header = int.from_bytes(f.read(8), "little")
                digest.update(f.read(min(header, 1 << 24)))
                start = 8 + header
            if sampled:
                for i in range(_SAMPLES):
                    f.seek(start + max(size - start - _BLOCK, 0) * i // (_SAMPLES - 1))
                    digest.update(f.read(_BLOCK))
    return digest.hexdigest()[:16]


def _resolved(path: Path) -> tuple[Path, int | None]:
    """A mimo checkpoint's folder (the tracker's iteration) for a save directory, and that iteration; any other
    path as given."""
    from .layout import iteration_dir, read_tracker

    iteration = read_tracker(path)
    return (iteration_dir(path, iteration) if iteration is not None else Path(path)), iteration


def _folder_record(value: Path) -> dict:
    """A base folder as the record keeps it: the path as given (a save directory: what --pretrained takes), the
    iteration a save directory's tracker names, and the fingerprint of what it holds now."""
    folder, iteration = _resolved(Path(value))
    return {"path": str(Path(value).resolve()), "checksum": checksum(folder), "fingerprint": FINGERPRINT,
            "iteration": iteration}


def base_record(options: CheckpointOptions, seed: int, from_checkpoint: dict | None = None) -> dict:
    """What the adapters are trained on: each base folder given (path, iteration and fingerprint), or none: the
    provider's initialization from `seed`. A run that resumed adapters keeps the record it loaded
    (`from_checkpoint`)."""
    if from_checkpoint is not None:
        return from_checkpoint
    folders = {name: _folder_record(getattr(options, name)) for name in BASE_OPTIONS
               if getattr(options, name) is not None}
    return {"folders": folders, "seed": None if folders else seed}


def check_saved(adapters_saved: bool, adapters_here: bool, directory: Path, what: str) -> None:
    """A checkpoint of adapters needs a LoRA run to load it; a LoRA run resumes only adapters."""
    if adapters_saved and not adapters_here:
        raise UsageError(f"{what} {directory} holds LoRA adapters only (saved by a run with --lora-rank): load them "
                         f"with the same --lora-* options and their base, or merge them into it first "
                         f"(mimo ckpt merge-lora)")
    if adapters_here and not adapters_saved and what == "--load":
        raise UsageError(f"--load {directory} holds a whole model, no adapters: to train adapters on it, give it as "
                         f"--pretrained")


def check_base(record: dict, options: CheckpointOptions, seed: int, directory: Path) -> None:
    """Refuse (one line) a load whose base is not the one the adapters in `directory` were trained on."""
    saved = record.get("folders", {})
    for name in BASE_OPTIONS:
        flag = _flag(name)
        given, was = getattr(options, name), saved.get(name)
        if was is None and given is None:
            continue
        if was is None or given is None:
            wanted = f"give {flag} {was['path']}" if was else f"drop {flag}"
            raise UsageError(f"the adapters in {directory} were trained on {describe(record)}; this command gives "
                             f"{f'{flag} {given}' if given else f'no {flag}'}: {wanted}")
        _check_unchanged(flag, Path(given), was, directory)
    if not saved and record.get("seed") != seed:
        raise UsageError(f"the adapters in {directory} were trained on the initialization of --seed "
                         f"{record.get('seed')}, this command has --seed {seed}: give --seed {record.get('seed')}")


def recorded_base(record: dict, directory: Path) -> dict[str, Path]:
    """{option: path} of the base folders the adapters in `directory` were trained on, each checked: still there
    and holding the same weights (one line naming what changed otherwise). {} for a seeded initialization."""
    bases = {}
    for name, was in record.get("folders", {}).items():
        flag, path = _flag(name), Path(was["path"])
        if not path.exists():
            raise UsageError(f"the adapters in {directory} were trained on {flag} {path}, which is no longer there: "
                             f"give {flag} PATH holding those weights")
        _check_unchanged(flag, path, was, directory)
        bases[name] = path
    return bases


def base_status(record: dict) -> str:
    """The recorded base now, in words, for `mimo ckpt inspect`: unchanged, gone, or what changed."""
    folders, states = record.get("folders", {}), []
    for name, was in folders.items():
        change = changed(Path(was["path"]), was) or "is unchanged since (the same fingerprint)"
        states.append(f"{_flag(name)} {change}" if len(folders) > 1 else f"it {change}")
    return "; ".join(states) or "the provider's initialization, rebuilt from the seed"


def changed(given: Path, was: dict) -> str | None:
    """What differs between the folder `given` and the record `was` of a base, in words; None: the same weights."""
    if not given.exists():
        return "is no longer there"
    folder, iteration = _resolved(given)
    if was.get("iteration") is not None and iteration is not None and iteration != was["iteration"]:
        return f"now holds iteration {iteration}, not {was['iteration']}"  # a base trained on since
    now = checksum(folder, was.get("fingerprint", 1))
    if now != was["checksum"]:
        return f"has changed since (fingerprint {now} now, {was['checksum']} then)"
    return None


def _check_unchanged(flag: str, given: Path, was: dict, directory: Path) -> None:
    """`given` holds the weights the record `was` fingerprinted, or one line naming what differs."""
    change = changed(given, was)
    if change is not None:
        where = "" if Path(given).resolve() == Path(was["path"]) else f" (they were trained on {was['path']})"
        raise UsageError(f"{flag} {given} is not the base the adapters in {directory} were trained on{where}: it "
                         f"{change}; give {flag} a folder holding those weights")


def describe(record: dict) -> str:
    """The base in words: `--pretrained PATH (iteration N)`, or the seeded initialization."""
    folders = record.get("folders", {})
    if not folders:
        return f"the initialization of --seed {record.get('seed')}"
    return ", ".join(f"{_flag(n)} {f['path']}" + (f" (iteration {f['iteration']})" if f.get("iteration") else "")
                     for n, f in folders.items())


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"
