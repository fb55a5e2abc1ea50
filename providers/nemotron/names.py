"""Parameter names in Nemotron (Megatron-LM LLaVA-style) checkpoints against megatron-core's MimoModel.

Only the three module prefixes differ; everything after them is megatron-core's own naming on both sides:

    language_model.     <->  language_model.
    vision_model.       <->  modality_submodules.images.encoders.radio.
    vision_projection.  <->  modality_submodules.images.input_projections.0.

MimoModel wraps each module in DDP for training, whose sharded keys carry `module.` after the module prefix
(`language_model.module.decoder...`); those are read without it.
"""

from __future__ import annotations

import re

from .settings import ENCODER, IMAGES

PREFIXES = (
    ("language_model.", "language_model."),
    ("vision_model.", f"modality_submodules.{IMAGES}.encoders.{ENCODER}."),
    ("vision_projection.", f"modality_submodules.{IMAGES}.input_projections.0."),
)

_WRAPPERS = re.compile(r"^(language_model\.|modality_submodules\.[^.]+\.)(?:module\.)+")


def unwrap(mimo_key: str) -> str:
    """The MimoModel name without DDP / Float16Module wrapper segments."""
    return _WRAPPERS.sub(r"\1", mimo_key)


def to_nemotron(mimo_key: str) -> str:
    """Nemotron name of a MimoModel parameter (or sharded-checkpoint key); ValueError for other names."""
    key = unwrap(mimo_key)
    for nemotron, mimo in PREFIXES:
        if key.startswith(mimo):
            return nemotron + key[len(mimo):]
    raise ValueError(f"{mimo_key!r} is not a parameter of the Nemotron VLM (language model, RADIO encoder or "
                     f"projection)")


def to_mimo(nemotron_key: str) -> str:
    """MimoModel name of a Nemotron checkpoint key; ValueError for other names."""
    for nemotron, mimo in PREFIXES:
        if nemotron_key.startswith(nemotron):
            return mimo + nemotron_key[len(nemotron):]
    raise ValueError(f"{nemotron_key!r} does not start with one of "
                     f"{', '.join(n for n, _ in PREFIXES)} (a Nemotron VLM checkpoint key)")
