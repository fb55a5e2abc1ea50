"""Loading megatron-core distributed checkpoints (torch_dist) with every torch release mimo supports.

megatron-core 0.19.2 describes a checkpoint's tensors by passing every field of torch's `TensorProperties` to
`torch.empty`. torch 2.15 added a `strides` field that `torch.empty` does not take, so every load that compares
the checkpoint with the model (megatron-core's `StrictHandling.RETURN_ALL`) fails there. The load strategy below
reads the same metadata itself, keeping only what a meta tensor needs (shape and dtype), and is handed to
megatron-core through `dist_checkpointing.load`'s `sharded_strategy` argument; the load itself is megatron-core's.
Core and providers load through `load` here.
"""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata


def saved_tensor_shapes(directory: str | Path, metadata: Metadata | None = None) -> dict[str, tuple]:
    """Every tensor the checkpoint holds: key -> (global shape, dtype)."""
    if metadata is None:
        metadata = FileSystemReader(str(directory)).read_metadata()
    return {key: (tuple(meta.size), meta.properties.dtype) for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)}


class TorchDistLoadStrategy(TorchDistLoadShardedStrategy):
    """megatron-core's torch_dist load strategy, describing the checkpoint's tensors from shape and dtype alone."""

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Metadata | None = None):
        return {key: ShardedTensor.from_rank_offsets(key, torch.empty(size, dtype=dtype, device="meta")).without_data()
                for key, (size, dtype) in saved_tensor_shapes(checkpoint_dir, metadata).items()}


def load(sharded_state: dict, directory: str | Path) -> tuple[dict, set[str]]:
    """Load `sharded_state` from the checkpoint in `directory` (collective over the world).

    Returns the loaded state and the keys this rank asked for that the checkpoint lacks (megatron-core calls those
    "unexpected"); they are left out of the load, and the caller decides whether that is an error."""
    loaded, absent, _ = load_with_unrequested(sharded_state, directory)
    return loaded, absent


def load_with_unrequested(sharded_state: dict, directory: str | Path) -> tuple[dict, set[str], set[str]]:
    """As `load`, and also the checkpoint's keys that no rank asked for (megatron-core's "missing" keys, agreed
    over the world)."""
    strategy = TorchDistLoadStrategy()
    loaded, unrequested, absent = dist_checkpointing.load(sharded_state, str(directory), sharded_strategy=strategy,
                                                          strict=StrictHandling.RETURN_ALL)
    return loaded, absent, unrequested
