"""Modules whose `forward` is replaced while a block runs: the one-token layers (one_token_moe.py,
one_token_attention.py) are set on the instances, so megatron-core's classes and every other model stay as they
are, and deleting the instance attribute puts the class's forward back."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def patched_forward(layers: list[tuple[object, object]]):
    """`layers`: (module, forward) pairs; yields how many were replaced."""
    for module, forward in layers:
        module.forward = forward
    try:
        yield len(layers)
    finally:
        for module, _ in layers:
            del module.forward
