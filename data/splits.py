"""Whether a dataset holds the split an evaluation reads, before any worker starts, and how to give it one.

A prepared energon dataset lists its splits' shards in `.nv-meta/split.yaml`; a split without shards is refused
in one line naming the option that gave the dataset (`--data` or `--eval-data`). A metadataset is left to the
loader, which says the same (`hold_out_hint`) when it opens the split.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from mimo.errors import UsageError

__all__ = ["check_split", "hold_out_hint"]


def hold_out_hint(split: str) -> str:
    """How a dataset gets `split` samples, with mimo's tools first."""
    ways = ["mimo data convert llava --val-fraction F", "mimo data sample --val-shards N",
            "energon prepare --split-ratio 8,2,0"] if split == "val" else \
        ["mimo data convert llava --test-fraction F", "energon prepare --split-ratio 8,1,1"]
    return f"hold some samples out for it when making the dataset ({', '.join(ways)}; docs/evaluation.md)"


def check_split(path, split: str, flag: str) -> None:
    """UsageError (one line) when the prepared dataset at `path` has no shard in `split`."""
    listed = Path(path) / ".nv-meta" / "split.yaml"
    if not listed.is_file():
        return  # a metadataset, or not a dataset: the loader and data/check.py say so
    try:
        parts = (yaml.safe_load(listed.read_text()) or {}).get("split_parts") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return  # unreadable: the loader names the problem
    if not parts.get(split):
        raise UsageError(f"{flag} {path}: the dataset has no {split} split: {hold_out_hint(split)}")
