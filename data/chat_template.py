"""Chat templates: a conversation (see `conversation.py`) as token ids, with the tokens to train on marked.

`NEMOTRON` is the prompt format of the Nemotron VL models (ChatML turns, InternVL-style image tags):

    <|im_start|>system\\n{system}<|im_end|>\\n
    <|im_start|>user\\n<img><image>...<image></img>{question}<|im_end|>\\n
    <|im_start|>assistant\\n{answer}<|im_end|>\\n

Each image slot becomes `<img>`, as many `<image>` placeholders as the vision encoder gives that image tokens
(after dynamic-resolution tiling and pixel shuffle), and `</img>`. A `document` turn is its text alone, between the
tokenizer's beginning-of-sequence token (when it has one) and its end-of-sequence token.

`PLAIN` has no turn markers: a prompt's text ends with a newline, an answer with end-of-sequence, and an image is
its placeholders alone (a captioning sample is `<image>...<image>\\ncaption</s>`). It suits byte-level smoke runs.

What is trained: an assistant turn's content and its end marker (`<|im_end|>`, or end-of-sequence), a document's
text and its end-of-sequence; never a turn header, a system or user turn, or an image placeholder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .conversation import ImageSlot, Turn
from .tokenizer import Tokenizer

__all__ = ["CHAT_TEMPLATES", "NEMOTRON", "PLAIN", "ChatTemplate", "RenderedConversation", "chat_template"]


@dataclass
class RenderedConversation:
    tokens: list[int]
    trained: list[bool]  # per token: a target to learn
    image_runs: list[tuple[int, int]] = field(default_factory=list)  # (first position, length) per image


@dataclass(frozen=True)
class ChatTemplate:
    """A prompt format. Every marker in `special_tokens` must be one token of the tokenizer."""

    name: str
    headers: Mapping[str, str]  # role -> text before the turn's content (system, user, assistant)
    prompt_end: str  # after a system or user turn's content
    answer_end: str | None  # after an assistant turn's content, trained; None: end-of-sequence
    turn_gap: str = ""  # after every chat turn (not a document), not trained
    image_start: str = ""
    image_end: str = ""
    special_tokens: tuple[str, ...] = ()

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """ValueError naming each marker the tokenizer does not encode as one token."""
        split = {t: len(tokenizer.encode(t)) for t in self.special_tokens}
        bad = [f"{t!r} ({n} tokens)" for t, n in split.items() if n != 1]
        if bad:
            raise ValueError(f"the {self.name} chat template needs these markers as single tokens of the tokenizer: "
                             f"{', '.join(bad)}")

    def render(self, turns: Sequence[Turn], image_tokens: Sequence[int], tokenizer: Tokenizer
               ) -> RenderedConversation:
        """The token ids of `turns`; the n-th image slot takes `image_tokens[n]` placeholders."""
        out = RenderedConversation([], [])
        images = iter(image_tokens)

        def add(ids: Sequence[int], trained: bool) -> None:
            out.tokens.extend(ids)
            out.trained.extend([trained] * len(ids))

        def text(value: str, trained: bool) -> None:
            if value:
                add(tokenizer.encode(value), trained)

        for turn in turns:
            content_trained = turn.role in ("assistant", "document")
            if turn.role == "document" and tokenizer.bos_id is not None:
                add([tokenizer.bos_id], False)  # so that the document's first token is learned too
            text(self.headers.get(turn.role, ""), False)
            for part in turn.parts:
                if isinstance(part, ImageSlot):
                    text(self.image_start, False)
                    count = next(images)
                    out.image_runs.append((len(out.tokens), count))
                    add([tokenizer.image_token_id] * count, False)
                    text(self.image_end, False)
                else:
                    text(part, content_trained)
            if turn.role == "document":
                add([tokenizer.eos_id], True)
                continue
            if turn.role == "assistant" and self.answer_end is None:
                add([tokenizer.eos_id], True)
            elif turn.role == "assistant":
                text(self.answer_end, True)
            else:
                text(self.prompt_end, False)
            text(self.turn_gap, False)
        return out

    def generation_prompt(self, turns: Sequence[Turn], image_tokens: Sequence[int], tokenizer: Tokenizer
                          ) -> list[int]:
        """The token ids that ask for the next answer: `turns` rendered, then the assistant's header. When the last
        turn is a document, the model continues it: its end-of-sequence is left off and no header follows."""
        tokens = self.render(turns, image_tokens, tokenizer).tokens
        if turns and turns[-1].role == "document":
            return tokens[:-1]
        return tokens + (tokenizer.encode(self.headers["assistant"]) if self.headers.get("assistant") else [])

    def stop_ids(self, tokenizer: Tokenizer) -> frozenset[int]:
        """The ids that end an answer: the template's end of an assistant turn, and end-of-sequence."""
        ends = {tokenizer.eos_id}
        if self.answer_end:
            ends.update(tokenizer.encode(self.answer_end))
        return frozenset(ends)


NEMOTRON = ChatTemplate(
    name="nemotron",
    headers={role: f"<|im_start|>{role}\n" for role in ("system", "user", "assistant")},
    prompt_end="<|im_end|>", answer_end="<|im_end|>", turn_gap="\n", image_start="<img>", image_end="</img>",
    special_tokens=("<|im_start|>", "<|im_end|>", "<img>", "</img>"),
)
PLAIN = ChatTemplate(name="plain", headers={}, prompt_end="\n", answer_end=None)

CHAT_TEMPLATES = {t.name: t for t in (NEMOTRON, PLAIN)}


def chat_template(name: str) -> ChatTemplate:
    if name not in CHAT_TEMPLATES:
        raise ValueError(f"unknown chat template {name!r} (templates: {', '.join(CHAT_TEMPLATES)})")
    return CHAT_TEMPLATES[name]
