"""Nemotron-format distributed checkpoints (megatron-core dist_checkpointing, keys `language_model.*`,
`vision_model.*`, `vision_projection.*`) to and from a MimoModel, in any layout.

Both functions are collective over the world: each rank describes the modules it holds (its own grid's shards),
and one `dist_checkpointing` call reads or writes all of them. Loading is strict: a tensor the model needs that
the checkpoint lacks raises `MissingCheckpointKeys`, and a weight under the model's prefixes that no rank's
modules hold raises `UnexpectedCheckpointKeys`, each naming keys, on every rank. What is not a model weight
(optimizer state, RNG, TE's `_extra_state`, ...) is ignored. `mimo run --pretrained DIR` reaches this through the
provider's `load_pretrained` hook.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensor, apply_factories

from mimo.errors import UsageError
from mimo.plugins.kit import dist_checkpoint

from .names import PREFIXES, to_nemotron

# State entries that carry no weights and that checkpoints may lack: TE's FP8 metadata (`_extra_state`; local
# modules keep an empty one) and the router's per-step token counter, which megatron-core zeroes every step.
OPTIONAL_SUFFIXES = ("_extra_state", ".local_tokens_per_expert")


def _shown(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


class MissingCheckpointKeys(UsageError):
    """The checkpoint lacks tensors the model needs."""

    def __init__(self, directory, keys: list[str]):
        self.keys = keys
        super().__init__(f"Nemotron checkpoint {directory} lacks {len(keys)} key(s) the model needs: {_shown(keys)}")


class UnexpectedCheckpointKeys(UsageError):
    """The checkpoint holds model weights this model has no place for (another shape of model)."""

    def __init__(self, directory, keys: list[str]):
        self.keys = keys
        super().__init__(f"Nemotron checkpoint {directory} holds {len(keys)} weight(s) the model has no place for "
                         f"(a model of other settings?): {_shown(keys)}")


def is_nemotron_checkpoint(directory) -> bool:
    """Whether the dist checkpoint in `directory` holds weights under Nemotron's module prefixes."""
    prefixes = tuple(nemotron for nemotron, _ in PREFIXES)
    return any(key.startswith(prefixes) for key in dist_checkpoint.saved_tensor_shapes(directory))


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
    # Checked before loading: megatron-core merges split tensors (Mamba's in_proj, conv1d) while loading and
    # fails there, with a traceback, when a part is absent or of another shape. Each rank checks its own modules;
    # every rank raises the same error (nobody waits forever in a collective).
    saved = dist_checkpoint.saved_tensor_shapes(directory)
    requested = _requested_tensor_shapes(model)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(k for k in requested if k not in saved))
    missing = sorted({key for keys in everyone for key in keys})
    if missing:
        raise MissingCheckpointKeys(directory, missing)
    dist.all_gather_object(everyone, sorted((k, shape, saved[k][0]) for k, shape in requested.items()
                                            if shape != saved[k][0]))
    if reshaped := sorted({entry for entries in everyone for entry in entries}):
        key, shape, stored = reshaped[0]
        raise UsageError(f"Nemotron checkpoint {directory} holds {key} of shape {list(stored)}, the model's is "
                         f"{list(shape)} (a model of other settings?)")
    # megatron-core's "missing" keys: the checkpoint's keys that no rank asked for, agreed over the world.
    loaded, _, unrequested = dist_checkpoint.load_with_unrequested(state, directory)
    prefixes = tuple(nemotron for nemotron, _ in PREFIXES)
    extra = sorted(key for key in unrequested
                   if key.startswith(prefixes) and not key.split("/")[0].endswith(OPTIONAL_SUFFIXES))
    if extra:
        raise UnexpectedCheckpointKeys(directory, extra)
    result = model.load_state_dict(loaded, strict=False)
    left = [name for name in result.missing_keys if not name.endswith(OPTIONAL_SUFFIXES)]
    if left or result.unexpected_keys:  # cannot happen when the request came from this model
        raise RuntimeError(f"loading {directory}: state dict mismatch, missing {left[:5]}, unexpected "
                           f"{result.unexpected_keys[:5]}")


def _requested_tensor_shapes(model) -> dict[str, tuple]:
    """{checkpoint key: global shape} of every tensor this rank's modules load, split tensors as their saved
    parts."""
    probe = nemotron_sharded_state_dict(model)
    apply_factories(probe)
    kept = {name: value for name, value in probe.items() if not name.endswith(OPTIONAL_SUFFIXES)}
    return {entry.key: tuple(entry.global_shape) for entry in nested_values(kept) if isinstance(entry, ShardedTensor)}
