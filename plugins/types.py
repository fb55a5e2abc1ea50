"""The records that pass between mimo and its plugins."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec


@dataclass(frozen=True)
class Provider:
    """A model family's entry in the registry.

    `settings` is the provider's typed settings dataclass; `defaults` overrides some of its defaults, so one
    family can register several variants (sizes) with one settings class and one implementation.
    """

    name: str
    description: str
    settings: type
    defaults: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModuleShape:
    """What layout validation and `mimo plan` need to know about one module, before it is built."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int | None = None
    num_experts: int | None = None
    # Parameter counts (total, and active per token for MoE); None when the provider does not report them.
    num_parameters: int | None = None
    num_active_parameters: int | None = None
    # The language model's vocabulary, which megatron-core splits evenly over TP (None: not checked).
    vocab_size: int | None = None


@dataclass(frozen=True)
class Encoder:
    """A modality's submodules (megatron-core `ModalitySubmodules` spec) and the token that marks its slots."""

    spec: ModuleSpec
    placeholder_token_id: int


@dataclass(frozen=True)
class PromptFormat:
    """How a conversation becomes this model's input and its output becomes text, for `mimo generate` and
    `--eval-samples` (hook `prompt_format`): the tokenizer (`mimo.plugins.data`), the chat template that renders
    the turns and ends an answer, the image mode that turns an image into the encoder's input and its placeholder
    count, and where that input goes, `modality_inputs[modality][encoder]` (None for a text-only model).
    `positions` (optional): the prompt's position ids as the task encoder's positions hook gives them (token ids
    [L] and the processed images -> [A, L], e.g. Qwen's 3-D multimodal RoPE positions); None: 0 .. L-1. The
    answer's tokens go on from the largest position + 1, the same on every axis."""

    tokenizer: Any
    template: Any
    image_mode: Any = None
    modality: str | None = None
    encoder: str | None = None
    positions: Any = None


@dataclass(frozen=True)
class KernelConfigs:
    """What hook `kernel_configs` returns: the Python modules whose Triton autotuned kernels a GPU run pins and
    records (e.g. "mamba_ssm.ops.triton.ssd_bmm"; one not installed is skipped) and the provider's recorded tables
    of their choices (as the compile cache's `kernel_configs.json`: gpu, capability, triton, kernels)."""

    modules: tuple[str, ...]
    tables: tuple[dict, ...] = ()

    @classmethod
    def of(cls, returned) -> KernelConfigs:
        """The hook's value as a record: None is nothing to tune; a plain list of tables (the hook's first form)
        tunes the modules its kernels are named after ("module.attribute")."""
        if returned is None:
            return cls(())
        if isinstance(returned, cls):
            return returned
        tables = tuple(returned)
        named = dict.fromkeys(kernel.rsplit(".", 1)[0] for table in tables for kernel in table.get("kernels", {}))
        return cls(tuple(named), tables)
