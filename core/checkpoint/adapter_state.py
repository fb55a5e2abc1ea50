"""Checkpoints of a LoRA run (--lora-rank): the adapters alone, with the base they were trained on named by path and
checksum. A resume loads that base first (the run's --pretrained, or the seeded initialization it was trained on)
and then the adapters and their optimizer state; a base that changed since is refused, not silently adapted.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from mimo.errors import UsageError

from ..adapters.apply import is_adapter_name
from ..config import CheckpointOptions

BASE = "base"
ADAPTERS = "adapters"
_BASE_OPTIONS = ("pretrained", "pretrained_llm", "pretrained_vision")


def model_part(state: dict, part: str | None) -> dict:
    """The sharded model state of `part`: the adapters' tensors, the base's (every other), or all (None)."""
    if part is None:
        return state
    keep = part == ADAPTERS
    return {key: value for key, value in state.items() if is_adapter_name(key) == keep}


def checksum(path: Path) -> str:
    """A fingerprint of a weights folder, cheap for any size: every file's name and size, and the shard CRC32s a
    mimo checkpoint records (checksums.json) or a safetensors file's header (its tensors' names, shapes and
    offsets)."""
    digest = hashlib.sha256()
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    for file in files:
        digest.update(f"{file.relative_to(root) if root.is_dir() else file.name}:{file.stat().st_size}\n".encode())
        if file.name == "checksums.json":
            digest.update(file.read_bytes())
        elif file.suffix == ".safetensors":
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                digest.update(f.read(min(size, 1 << 24)))
    return digest.hexdigest()[:16]


def _resolved(path: Path) -> Path:
    """A mimo checkpoint's folder (the tracker's iteration) for a save directory; any other path as given."""
    from .layout import iteration_dir, read_tracker

    iteration = read_tracker(path)
    return iteration_dir(path, iteration) if iteration is not None else Path(path)


def base_record(options: CheckpointOptions, seed: int, from_checkpoint: dict | None = None) -> dict:
    """What the adapters are trained on: each base folder given (path and checksum), or none: the provider's
    initialization from `seed`. A run that resumed adapters keeps the record it loaded (`from_checkpoint`)."""
    if from_checkpoint is not None:
        return from_checkpoint
    folders = {}
    for name in _BASE_OPTIONS:
        value = getattr(options, name)
        if value is not None:
            # the path as given (a save directory: what --pretrained takes), the checksum of what it holds now
            folders[name] = {"path": str(Path(value).resolve()), "checksum": checksum(_resolved(Path(value)))}
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
    """Refuse a resume whose base is not the one the adapters in `directory` were trained on."""
    saved = record.get("folders", {})
    for name in _BASE_OPTIONS:
        flag = f"--{name.replace('_', '-')}"
        given, was = getattr(options, name), saved.get(name)
        if was is None and given is None:
            continue
        if was is None or given is None:
            wanted = f"{flag} {was['path']}" if was else f"no {flag}"
            raise UsageError(f"the adapters in {directory} were trained on {_describe(record)}; this run gives "
                             f"{f'{flag} {given}' if given else f'no {flag}'}: resume with {wanted}")
        now = checksum(_resolved(Path(given)))
        if now != was["checksum"]:
            raise UsageError(f"{flag} {given} is not the base the adapters in {directory} were trained on "
                             f"(checksum {now} here, {was['checksum']} recorded for {was['path']})")
    if not saved and record.get("seed") != seed:
        raise UsageError(f"the adapters in {directory} were trained on the initialization of --seed "
                         f"{record.get('seed')}, this run has --seed {seed}: resume with --seed {record.get('seed')}")


def _describe(record: dict) -> str:
    folders = record.get("folders", {})
    if not folders:
        return f"the initialization of --seed {record.get('seed')}"
    return ", ".join(f"--{n.replace('_', '-')} {f['path']}" for n, f in folders.items())
