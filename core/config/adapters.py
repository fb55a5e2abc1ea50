"""The options of low-rank adapters (LoRA): the loop trains small adapters beside frozen base weights when
`--lora-rank` is above 0. Which layers they wrap is `--lora-targets` (default: the provider's `lora_targets` hook);
core/adapters/ builds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mimo.errors import UsageError

from .option import Options, option

EXPERT_LAYOUTS = ("shared", "per-expert", "shared-outer")
# Target names that are no layer name: the routed experts' linears, the shared experts' linears, every linear.
EXPERTS, SHARED_EXPERTS, ALL = "experts", "shared_experts", "all"
# A target module that is no model module: every modality's input projection.
PROJECTION = "projection"


@dataclass
class AdapterOptions(Options):
    """LoRA: each targeted linear computes W x + (alpha / rank) B A x with W frozen, A [rank, in] random and B
    [out, rank] zero at the start (step 0 is the base model). Only A and B train."""

    lora_rank: int = option(0, "rank of the LoRA adapters; 0: no adapters, every weight trains as usual")
    lora_alpha: float | None = option(None, "LoRA scale numerator: adapters add (alpha / rank) B A x "
                                            "(default: 2 x rank)")
    lora_dropout: float = option(0.0, "dropout on the adapters' input")
    lora_targets: str | None = option(
        None, "the linears that get adapters, per module: MODULE:NAME,NAME;MODULE:... with MODULE language, a "
              "modality (its encoders) or projection (the input projections), NAME a layer name (linear_qkv, "
              "linear_proj, linear_fc1, linear_fc2, in_proj, out_proj, ...), experts (the routed experts), "
              "shared_experts or all (default: the provider's lora_targets)")
    lora_experts: Literal["shared", "per-expert", "shared-outer"] = option(
        "shared", "routed experts: one adapter per layer shared by all its experts (small), one per expert, or "
                  "shared-outer: fc1's A and fc2's B shared by the layer's experts, the other halves per expert (not "
                  "exportable with --adapter-only: merge first)")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def scale(self) -> float:
        alpha = self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank
        return alpha / self.lora_rank

    def check(self) -> None:
        if self.lora_rank < 0:
            raise UsageError(f"--lora-rank must be 0 (no adapters) or more, got {self.lora_rank}")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise UsageError(f"--lora-alpha must be positive, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise UsageError(f"--lora-dropout must lie in [0, 1), got {self.lora_dropout}")
        if not self.enabled:
            for name, value, default in (("--lora-targets", self.lora_targets, None),
                                         ("--lora-alpha", self.lora_alpha, None),
                                         ("--lora-dropout", self.lora_dropout, 0.0)):
                if value != default:
                    raise UsageError(f"{name} needs --lora-rank R (above 0): without it no adapters are built")
        if self.lora_targets is not None:
            parse_targets(self.lora_targets)

    def targets(self) -> dict[str, tuple[str, ...]] | None:
        """--lora-targets as {module: names}, or None where not given."""
        return None if self.lora_targets is None else parse_targets(self.lora_targets)


def parse_targets(text: str) -> dict[str, tuple[str, ...]]:
    """`language:linear_qkv,linear_proj;images:all` -> {module: (name, ...)}; one line naming what is wrong."""
    targets: dict[str, tuple[str, ...]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        module, sep, names = part.partition(":")
        module = module.strip()
        listed = tuple(dict.fromkeys(n.strip() for n in names.split(",") if n.strip()))
        if not sep or not module or not listed:
            raise UsageError(f"--lora-targets {text!r}: write MODULE:NAME,NAME;MODULE:NAME (e.g. "
                             f"language:linear_qkv,linear_proj;images:all), got {part!r}")
        if module in targets:
            raise UsageError(f"--lora-targets names module '{module}' twice")
        targets[module] = listed
    if not targets:
        raise UsageError(f"--lora-targets {text!r} names no module: write MODULE:NAME,NAME;MODULE:NAME")
    return targets
