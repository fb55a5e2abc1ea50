"""Hugging Face model folders: their safetensors read lazily by tensor name, and written so `from_pretrained` loads
them.

A folder holds either one `model.safetensors`, or shards listed in `model.safetensors.index.json`
(`{"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file}}`), next to `config.json`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from mimo.errors import UsageError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size


def library():
    """The safetensors library (the `hf` extra), or one line saying how to install it."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError:
        raise UsageError("Hugging Face folders need the safetensors library: pip install 'mimo[hf]'") from None
    return safetensors


class SafetensorsFolder(Mapping[str, torch.Tensor]):
    """A folder's tensors by name; each is read from its file (memory-mapped) only when asked for."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._files: dict[str, str] = _weight_map(self.folder)  # tensor name -> file name
        self._open: dict[str, object] = {}  # file name -> safe_open handle, opened on first use

    def __getitem__(self, name: str) -> torch.Tensor:
        file = self._files[name]
        if file not in self._open:
            self._open[file] = library().safe_open(self.folder / file, framework="pt")
        return self._open[file].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def read_config(folder: str | Path) -> dict:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise UsageError(f"{folder} has no {CONFIG_FILE}")
    return json.loads(path.read_text())


def save(folder: str | Path, tensors: Mapping[str, torch.Tensor], config: dict,
         max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write `tensors` (in their order) as `model.safetensors`, or as shards `model-0000i-of-0000n.safetensors`
    with the index when they exceed `max_shard_bytes`, and `config` as config.json. The folder may exist but must
    not hold a checkpoint already: stale shards next to new ones would be read as one model."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in folder.glob("*.safetensors")) + [n for n in (INDEX_FILE,) if (folder / n).exists()]
    if stale:
        raise UsageError(f"{folder} already holds a checkpoint ({', '.join(stale)}); write to an empty folder")
    save_file = library().torch.save_file
    shards = _shards({name: _standalone(t) for name, t in _unshared(tensors).items()}, max_shard_bytes)
    names = [SINGLE_FILE] if len(shards) == 1 else \
        [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for name, shard in zip(names, shards):
        save_file(shard, folder / name, metadata={"format": "pt"})  # "pt": what transformers checks for
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(t) for s in shards for t in s.values())},
                 "weight_map": {tensor: file for file, shard in zip(names, shards) for tensor in shard}}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _weight_map(folder: Path) -> dict[str, str]:
    if (folder / INDEX_FILE).is_file():
        return json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    if (folder / SINGLE_FILE).is_file():
        with library().safe_open(folder / SINGLE_FILE, framework="pt") as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise UsageError(f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that safetensors can write: detached and contiguous (the same bits)."""
    return t.detach().to("cpu").contiguous()


def _unshared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors, with a copy of each one whose memory an earlier one already uses (safetensors refuses
    tensors that share memory, e.g. views of one stacked tensor)."""
    seen, out = set(), {}
    for name, t in tensors.items():
        key = (t.device, t.untyped_storage().data_ptr()) if t.numel() else None
        out[name] = t.clone() if key in seen else t
        if key is not None:
            seen.add(key)
    return out


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most `max_bytes` each (a larger tensor gets a shard of its own)."""
    shards, size = [{}], 0
    for name, t in tensors.items():
        if shards[-1] and size + _nbytes(t) > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += _nbytes(t)
    return shards
