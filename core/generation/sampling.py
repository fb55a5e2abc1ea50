"""Choosing the next token from the language model's logits: greedy (temperature 0, the default) or sampled with
a temperature, top-k and nucleus (top-p) filtering, from a generator of its own seeded per prompt, so answers
repeat with the same seed and the training run's random streams are never drawn from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mimo.errors import UsageError


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int = 1234

    def validate(self) -> None:
        if not self.temperature >= 0:
            raise UsageError(f"--temperature must be 0 (greedy) or more, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be 0 (no limit) or more, got {self.top_k}")


class Sampler:
    def __init__(self, options: SamplingOptions, device: torch.device):
        options.validate()
        self.options, self.device = options, device
        self.generator = None

    def start(self, prompt_index: int) -> None:
        """Before each prompt: the generator seeded with seed + index, so a prompt's answer does not depend on
        which prompts came before it."""
        if self.options.temperature > 0:
            self.generator = torch.Generator(device=self.device).manual_seed(self.options.seed + prompt_index)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] -> the chosen token id as a [1, 1] tensor on the logits' device."""
        o = self.options
        if o.temperature == 0:
            return logits.argmax(-1).view(1, 1)
        scores = logits.float() / o.temperature
        if o.top_k and o.top_k < scores.numel():
            kth = torch.topk(scores, o.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if o.top_p < 1:
            ordered, order = torch.sort(scores, descending=True)
            probs = torch.softmax(ordered, -1)
            outside = probs.cumsum(-1) - probs >= o.top_p  # tokens after the nucleus is full; the first always stays
            scores = scores.scatter(0, order, ordered.masked_fill(outside, float("-inf")))
        if self.generator is None:
            self.start(0)
        return torch.multinomial(torch.softmax(scores, -1), 1, generator=self.generator).view(1, 1)
