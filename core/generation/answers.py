"""Answers to prompts, one at a time: each prompt rendered in the provider's prompt format, decoded, and its tokens
turned back into text; a prompt with a reference is scored (text_metrics.py). Shared by `mimo generate` and the
predictions of evaluations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from mimo.data.prompts import EncodedPrompt, Prompt, encode
from mimo.errors import UsageError

from .decoder import Decoder, Generated
from .sampling import Sampler
from .text_metrics import exact_match, token_f1


def prompt_format_of(hooks, settings, provider: str):
    """The provider's PromptFormat; one line when it cannot generate."""
    fmt = hooks.prompt_format(settings=settings)
    if fmt is None:
        raise UsageError(f"provider '{provider}' cannot generate: it implements no prompt_format hook "
                         f"(docs/provider-guide.md#generation)")
    return fmt


@dataclass
class Answer:
    prompt: Prompt
    encoded: EncodedPrompt
    generated: Generated
    text: str

    @property
    def scores(self) -> dict:
        if self.prompt.reference is None:
            return {}
        return {"exact_match": exact_match(self.text, self.prompt.reference),
                "token_f1": token_f1(self.text, self.prompt.reference)}

    def record(self) -> dict:
        g = self.generated
        return {"key": self.prompt.key or None, "prompt": self.prompt.question, "reference": self.prompt.reference,
                "answer": self.text, "prompt_tokens": self.encoded.num_tokens, "answer_tokens": len(g.tokens),
                "stop": g.stop, **self.scores}


def answer_all(decoder: Decoder, fmt, prompts: Iterable[Prompt], *, sampler: Sampler,
               max_new_tokens: int) -> Iterator[Answer]:
    """Each prompt's answer, in order (collective: every rank answers every prompt together)."""
    stop_ids = fmt.template.stop_ids(fmt.tokenizer)
    for index, prompt in enumerate(prompts):
        sampler.start(index)
        encoded = encode(prompt, fmt)
        generated = decoder.generate(encoded, max_new_tokens=max_new_tokens, stop_ids=stop_ids, sampler=sampler)
        yield Answer(prompt, encoded, generated, fmt.tokenizer.decode(generated.tokens))
