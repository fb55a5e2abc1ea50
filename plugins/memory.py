"""What a provider tells mimo about its modules' memory (the optional `module_memory` hook), in units mimo can
turn into bytes per rank for any layout: parameter elements by how they split over the ranks, and activation
bytes kept per token by how they split, for each recompute mode.

Parameters are counted whole (unsharded); mimo divides them by the module's TP, EP x expert-TP and pipeline
stages. Activations are bytes per token of one micro-batch for one layer, kept from its forward until its
backward; mimo multiplies them by the tokens a rank holds and the micro-batches in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable

RECOMPUTE = ("none", "selective", "full")


class _Additive:
    """Field-wise + and scaling, for the records below."""

    def __add__(self, other):
        return type(self)(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __mul__(self, k):
        return type(self)(*(getattr(self, f.name) * k for f in fields(self)))


@dataclass(frozen=True)
class Weights(_Additive):
    """Parameter elements, unsharded, by how megatron-core splits them."""

    tp: int = 0  # split over tensor parallelism: column/row-parallel weights, vocab-parallel embeddings
    replicated: int = 0  # whole on every TP rank: norms, biases of row-parallel layers, routers, Mamba's per-head
    expert: int = 0  # routed experts: split over expert parallelism x expert tensor parallelism

    @property
    def total(self) -> int:
        return self.tp + self.replicated + self.expert


@dataclass(frozen=True)
class TokenBytes(_Additive):
    """Activation bytes per token, by how they split over a module's ranks."""

    replicated: float = 0.0  # [tokens, hidden] tensors (norm inputs, residuals): split over TP only with
    #                          sequence parallelism
    tp: float = 0.0  # split over TP: attention heads, MLP columns, vocabulary shards
    expert: float = 0.0  # routed tokens (top-k copies of each token) inside the experts; with sequence
    #                      parallelism split over TP like the tokens they copy

    @property
    def total(self) -> float:
        return self.replicated + self.tp + self.expert


# (recompute mode, bytes of one activation value: 2 in bf16, 4 in fp32) -> bytes kept per token
Kept = Callable[[str, int], TokenBytes]


def nothing_kept(mode: str, value_bytes: int) -> TokenBytes:
    return TokenBytes()


@dataclass(frozen=True)
class LayerMemory:
    """One layer: its parameters and what its forward keeps for backward."""

    kind: str  # a name for the tables: attention, mlp, moe, mamba, vit, ...
    weights: Weights
    kept: Kept  # what the layer keeps per token, by recompute mode
    # what backward needs on top while it runs through this layer (e.g. the layer recomputed under full
    # recomputation); counted once, for the largest layer of a stage
    working: Kept = nothing_kept
    # the part of `kept` that only weight gradients read (their GEMMs' inputs), by part: where a part's weights
    # train nothing (frozen, no adapter), autograd does not keep it
    wgrad_inputs: Kept = nothing_kept
    # routed experts run as one grouped GEMM over their weights stacked (mimo.plugins.kit.grouped_mm_moe): where the
    # weights do not lie back to back (the distributed optimizer's buffer), the forward keeps a stacked copy
    stacked_experts: bool = False


@dataclass(frozen=True)
class ModuleMemory:
    """One module (the language model, or an encoder with its projection), as `module_memory` returns it.

    Pipeline stages take consecutive, equal shares of `layers` (megatron-core's split). `first` is what only the
    first stage holds (embeddings, patch embedder, position tables), `last` what only the last stage holds
    (final norm, output layer and loss; an encoder's projection). `tokens_per_sample` is the tokens each layer
    sees per sample at the largest the data makes them (an LLM: its sequence length; an encoder: patches of the
    largest images a sample can carry, class tokens included). `mean_tokens_per_sample`, for an encoder whose
    inputs vary in size: the tokens of an average sample of the provider's data (`--image-patches mean`).
    """

    layers: tuple[LayerMemory, ...]
    tokens_per_sample: float
    first: LayerMemory = field(default_factory=lambda: LayerMemory("input", Weights(), nothing_kept))
    last: LayerMemory = field(default_factory=lambda: LayerMemory("output", Weights(), nothing_kept))
    mean_tokens_per_sample: float | None = None  # None: the same as tokens_per_sample
    # an encoder's tokens per image placeholder of the LLM's row, at most (e.g. patches per placeholder after pixel
    # shuffle, plus class tokens over the smallest image's placeholders): with sequence packing a row carries up to
    # --pack-image-tokens placeholders, and the encoder that many times this many tokens. None: the estimate
    # assumes one sample's media per row (tokens_per_sample), which packing can exceed
    tokens_per_image_token: float | None = None

    @property
    def weights(self) -> Weights:
        total = self.first.weights + self.last.weights
        for layer in self.layers:
            total = total + layer.weights
        return total
