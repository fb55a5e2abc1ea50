"""Nemotron-format distributed checkpoints (megatron-core dist_checkpointing, keys `language_model.*`,
`vision_model.*`, `vision_projection.*`) to and from a MimoModel, in any layout.

Both functions are collective over the world: each rank describes the modules it holds (its own grid's shards),
and one `dist_checkpointing` call reads or writes all of them. Loading is strict: a tensor the model needs that
the checkpoint lacks raises `MissingCheckpointKeys` naming it, on every rank. Keys the checkpoint has and the
model does not (optimizer state, TE's attention `_extra_state`, ...) are ignored.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase

from mimo.plugins import dist_checkpoint

from .names import to_nemotron

# State entries that carry no weights and that checkpoints may lack: TE's FP8 metadata (`_extra_state`; local
# modules keep an empty one) and the router's per-step token counter, which megatron-core zeroes every step.
OPTIONAL_SUFFIXES = ("_extra_state", ".local_tokens_per_expert")


class MissingCheckpointKeys(KeyError):
    """The checkpoint lacks tensors the model needs."""

    def __init__(self, directory, keys: list[str]):
        self.keys = keys
        shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        super().__init__(f"Nemotron checkpoint {directory} lacks {len(keys)} key(s) the model needs: {shown}")

    def __str__(self):
        return self.args[0]


def nemotron_sharded_state_dict(model) -> dict:
    """This rank's part of the MimoModel's sharded state dict, its checkpoint keys in the Nemotron layout.

    The dict's own keys stay the model's state-dict names, so the loaded result goes to `load_state_dict`.
    """
    state = model.sharded_state_dict()
    for entry in nested_values(state):
        if isinstance(entry, ShardedBase):
            entry.key = to_nemotron(entry.key)
    return state


def save_nemotron_checkpoint(model, directory: str) -> None:
    """Write the model's weights as a Nemotron-format checkpoint into the (existing, empty) `directory`.

    dist_checkpointing's saver starts a helper process: a script calling this needs an
    `if __name__ == "__main__":` guard."""
    dist_checkpointing.save(nemotron_sharded_state_dict(model), str(directory))


def load_nemotron_checkpoint(model, directory: str) -> None:
    """Load a Nemotron-format checkpoint into the MimoModel, strictly (see the module docstring)."""
    state = {name: entry for name, entry in nemotron_sharded_state_dict(model).items()
             if not name.endswith(OPTIONAL_SUFFIXES)}
    # megatron-core names mismatches from the checkpoint's side: "unexpected" are keys this rank asked for that
    # the checkpoint lacks (left out of the load), "missing" are checkpoint keys no rank asked for.
    loaded, absent = dist_checkpoint.load(state, directory)
    # Each rank knows what its own modules lack; every rank raises the same error (nobody waits forever).
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(absent))
    missing = sorted({key for keys in everyone for key in keys})
    if missing:
        raise MissingCheckpointKeys(directory, missing)
    result = model.load_state_dict(loaded, strict=False)
    left = [name for name in result.missing_keys if not name.endswith(OPTIONAL_SUFFIXES)]
    if left or result.unexpected_keys:  # cannot happen when the request came from this model
        raise RuntimeError(f"loading {directory}: state dict mismatch, missing {left[:5]}, unexpected "
                           f"{result.unexpected_keys[:5]}")
