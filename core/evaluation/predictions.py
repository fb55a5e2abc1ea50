"""Predictions at each evaluation (`--eval-samples N`): greedy answers to the first N answer turns of the eval
split, scored against the dataset's answers by exact match and token F1, and logged (console excerpt, metrics
file, TensorBoard text).

The prompts are read once, before training, in the dataset's stored order (never the training data or the loss
evaluation's iterator). Answers are made inside the evaluation's guarded block (eval mode, no gradients, RNG states
put back, parameters gathered) and draw no random numbers, so training goes on exactly as without them.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from mimo.data.prompts import from_dataset
from mimo.errors import UsageError
from mimo.wording import counted

from ..generation.answers import answer_all, prompt_format_of
from ..generation.decoder import Decoder, check_plan
from ..generation.sampling import Sampler, SamplingOptions
from ..generation.text_metrics import mean

WAY_OUT = "drop --eval-samples and answer with mimo generate --load on a saved checkpoint"
EXCERPTS = 2  # answers shown on the console at each evaluation
EXCERPT_CHARS = 80


def check_predictions(plan) -> None:
    """Plan-time checks of --eval-samples (one line each): a dataset with answers, a provider and a layout that
    can generate."""
    e = plan.config.evaluation
    if not e.eval_samples:
        return
    if not (e.eval_data or plan.config.data.data):
        raise UsageError("--eval-samples needs --data or --eval-data (a dataset with answers to compare with; the "
                         "provider's synthetic data has none)")
    check_plan(plan, WAY_OUT)
    prompt_format_of(plan.hooks, plan.settings, plan.config.provider)


@dataclass
class Predictions:
    records: list[dict]  # per answer: key, prompt, reference, answer, token counts, stop, exact_match, token_f1

    @property
    def exact_match(self) -> float | None:
        return mean(r["exact_match"] for r in self.records)

    @property
    def token_f1(self) -> float | None:
        return mean(r["token_f1"] for r in self.records)

    def summary(self, split: str, iteration: int) -> list[str]:
        lines = [f"predictions ({split}) at iteration {iteration} | exact match {self.exact_match:.3f} | token F1 "
                 f"{self.token_f1:.3f} | {counted(len(self.records), 'answer')}"]
        for r in self.records[:EXCERPTS]:
            lines.append(f"  Q: {_cut(r['prompt'])} | reference: {_cut(r['reference'])} | answer: {_cut(r['answer'])}")
        return lines

    def markdown(self) -> str:
        """A table for TensorBoard's text tab."""
        rows = ["| prompt | reference | answer | F1 |", "| --- | --- | --- | --- |"]
        rows += [f"| {_cell(r['prompt'])} | {_cell(r['reference'])} | {_cell(r['answer'])} | {r['token_f1']:.2f} |"
                 for r in self.records]
        return "\n".join(rows)


class Predictor:
    """Answers the same prompts at every evaluation (collective: every rank decodes them together)."""

    def __init__(self, options, *, world, model, data_path: str, split: str):
        plan = world.plan
        self.fmt = prompt_format_of(plan.hooks, plan.settings, plan.config.provider)
        with _random_state_kept():  # energon's loader draws from the global generators; training must not see it
            self.prompts, _ = from_dataset(Path(data_path), split, options.eval_samples)
        self.model, self.device, self.params_dtype = model, world.device, world.params_dtype
        self.max_new_tokens = options.eval_max_new_tokens

    def predict(self) -> Predictions:
        decoder = Decoder(self.model, device=self.device, params_dtype=self.params_dtype)  # this evaluation's weights
        answers = answer_all(decoder, self.fmt, self.prompts, sampler=Sampler(SamplingOptions(), self.device),
                             max_new_tokens=self.max_new_tokens)
        return Predictions([a.record() for a in answers])


@contextlib.contextmanager
def _random_state_kept():
    import numpy as np

    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def _cut(text: str | None) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS - 3] + "..."


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")
