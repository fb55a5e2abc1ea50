"""A checkpoint compared with the run before any tensor is read: its saved settings and tensor shapes against the
model this run built, and the loop options a resume must keep. Each mismatch is one line.

The tensors decide: settings that shape no tensor (a training stage, dropout, the backend, data settings) may
differ. When a tensor differs, the line names the settings that differ, with both values (those whose values are
the tensor's sizes first), or, when the settings agree, the tensor with both shapes.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from mimo.errors import UsageError

# Loop options a resumed run keeps while it loads the checkpoint's optimizer state: megatron-core finds the saved
# parameter groups by their learning rates, and only bf16 runs keep fp32 main weights in the optimizer state.
# Every other option may change on resume: the layout (checkpoints reshard), the launch, logging, checkpoint
# paths, data workers, batch sizes, the seed and the run's length.
KEPT_WITH_OPTIMIZER_STATE = {("training", "precision"): "--precision", ("optimizer", "lr"): "--lr",
                             ("optimizer", "min_lr"): "--min-lr",
                             # the precision-aware optimizer's state has other dtypes and the main weights' remainders
                             ("optimizer", "optimizer_precision"): "--optimizer-precision"}
SHOWN_SETTINGS = 3


def check_model_fits(model, saved_settings: dict, settings: dict, directory: Path, what: str,
                     state: dict | None = None) -> None:
    """Refuse (UsageError, the same line on every rank) a checkpoint whose tensors differ from the model's (or
    from `state`, part of the model's sharded state: a LoRA run's base or adapters).

    Reads only the checkpoint's metadata. Collective: every rank compares the modules it holds."""
    from mimo.plugins.kit.dist_checkpoint import saved_tensor_shapes

    try:
        saved = saved_tensor_shapes(directory)
    except Exception as err:  # noqa: BLE001 - unreadable metadata, whatever the cause
        raise UsageError(f"checkpoint file {Path(directory) / '.metadata'} cannot be read "
                         f"({type(err).__name__})") from None
    local = first_difference(model_shapes(model.sharded_state_dict() if state is None else state), saved)
    found = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, local)
    difference = next((d for d in found if d is not None), None)
    if difference is not None:
        raise UsageError(mismatch_line(difference, saved_settings, settings, directory, what))


def model_shapes(sharded_state: dict) -> dict[str, tuple]:
    """Checkpoint key -> global shape of every tensor in a sharded state dict (factories built, not applied)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    shapes = {}
    pending = list(nested_values(sharded_state))
    while pending:
        value = pending.pop()
        if isinstance(value, ShardedTensorFactory):
            built = value.build()
            pending += list(nested_values(built)) if isinstance(built, (dict, list)) else [built]
        elif isinstance(value, ShardedTensor):
            shapes[value.key] = tuple(value.global_shape)
    return shapes


def first_difference(expected: dict[str, tuple], saved: dict[str, tuple]) -> tuple | None:
    """(key, saved shape or None when absent, expected shape) of the first tensor, in key order, that differs.
    Tensors the checkpoint holds beyond the model's are not a difference (the load leaves them out)."""
    for key in sorted(expected):
        there = tuple(saved[key][0]) if key in saved else None
        if there != expected[key]:
            return key, there, expected[key]
    return None


def differing_settings(saved: dict, settings: dict) -> list[tuple[str, object, object]]:
    """(name, saved value, this run's value) for each setting both know that differs, in the run's order."""
    plain = _plain
    return [(name, saved[name], value) for name, value in settings.items()
            if name in saved and plain(saved[name]) != plain(value)]


def mismatch_line(difference: tuple, saved_settings: dict, settings: dict, directory: Path, what: str) -> str:
    key, there, here = difference
    tensor = (f"tensor {key} is not in the checkpoint (shape {_shape(here)} here)" if there is None else
              f"tensor {key} has shape {_shape(there)} there, {_shape(here)} here")
    differing = differing_settings(saved_settings, settings)
    if not differing:
        return f"{what} {directory} does not fit this run's model: {tensor}"
    sizes = set(there or ()) | set(here)
    differing.sort(key=lambda d: not (d[1] in sizes or d[2] in sizes))  # settings that are the tensor's sizes
    named = "; ".join(f"{name} {old!r} there, {new!r} here" for name, old, new in differing[:SHOWN_SETTINGS])
    more = f" (and {len(differing) - SHOWN_SETTINGS} more)" if len(differing) > SHOWN_SETTINGS else ""
    return (f"{what} {directory} was saved with other settings: {named}{more}; its model does not fit this run's "
            f"({tensor})")


def check_kept_options(saved_options: dict, options: dict, directory: Path) -> None:
    """Refuse a resume that loads optimizer state under another precision or learning rate (one line)."""
    for (part, name), flag in KEPT_WITH_OPTIMIZER_STATE.items():
        old, new = (saved_options or {}).get(part, {}).get(name), options.get(part, {}).get(name)
        if old is not None and old != new:
            also = " --no-load-scheduler" if name in ("lr", "min_lr") else ""  # the schedule holds the rates too
            raise UsageError(f"{flag} {new} differs from the checkpoint's {old} ({directory}), whose optimizer state "
                             f"belongs to {flag} {old}: resume with {flag} {old}, or pass --no-load-optim{also} "
                             f"(a fresh optimizer)")


def _plain(value):
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _shape(shape: tuple) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"
