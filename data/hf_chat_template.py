"""A Hugging Face folder's own chat template: its Jinja template rendered as transformers' `apply_chat_template`
renders it, tokenized whole by the folder's tokenizer, the assistant turns trained.

The template is the folder's `chat_template.jinja`, else `chat_template.json` (a processor's: `{"chat_template":
...}`), else `tokenizer_config.json`'s `chat_template` (a string, or named templates of which `default` is taken).
It is rendered by transformers' own renderer (`render_jinja_template`, the function `apply_chat_template` calls:
its sandbox, filters and `{% generation %}` tracking), so a template renders here exactly as there; that needs the
`hf` extra (`pip install 'mimo[hf]'`). The template sees `messages` (roles system, user, assistant; content a
string, or a list of `{"type": "text", "text": ...}` and `{"type": "image"}` parts when the turn has images),
`add_generation_prompt` and the folder's named special tokens (`bos_token`, `eos_token`, ...).

What is trained: with a template that marks the answers with `{% generation %}` tags, the tokens of those blocks
(what `return_assistant_tokens_mask` marks); otherwise each assistant turn's text found by rendering the turns
before it with the generation prompt and the turns up to it without, and taking the difference (no markers
guessed), less its surrounding whitespace: the answer and the template's end of turn (`<|im_end|>`), never the
header or the newline after it. A template that renders the earlier turns differently once a later one follows has
no such difference; a conversation it renders is then refused (a bad sample) with a line asking for the tags.

Images: the template writes `ImageMarkers.placeholder` for each image part (`<|image_pad|>` in the Qwen family,
`<image>` in mimo's Nemotron export); each becomes `before`, the image's token count of the tokenizer's image token,
and `after`. A `document` turn is no chat: its text between the tokenizer's beginning and end of sequence, as in
the hand-written templates (`chat_template.py`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mimo.errors import UsageError
from mimo.wording import counted

from .chat_template import RenderedConversation, chat_template
from .conversation import ImageSlot, Turn
from .tokenizer import CONFIG_FILE, Tokenizer, _first_line, _read_json_object, _special_tokens_of

__all__ = ["AUTO", "TOKENIZER", "HFChatTemplate", "ImageMarkers", "load_hf_chat_template", "select_chat_template",
           "template_source"]

TOKENIZER = "tokenizer"  # the `chat_template` choice: the tokenizer folder's own template
AUTO = "auto"  # the folder's own template when it has one, else the provider's hand-written one
JINJA_FILE, PROCESSOR_FILE = "chat_template.jinja", "chat_template.json"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE_ANSWER = "Yes, it is."  # the answer rendered to find the template's end of turn


@dataclass(frozen=True)
class ImageMarkers:
    """How an image appears: the text the template writes for an image part (one token of the tokenizer), and the
    text mimo puts before and after the image's placeholder tokens in its place."""

    placeholder: str
    before: str = ""
    after: str = ""


def template_source(folder: str | Path) -> str | None:
    """The folder's chat template (see the module docstring for where it is looked for), or None."""
    folder = Path(folder)
    if (folder / JINJA_FILE).is_file():
        return (folder / JINJA_FILE).read_text(encoding="utf-8")
    for name in (PROCESSOR_FILE, CONFIG_FILE):
        value = _read_json_object(folder / name).get("chat_template")
        if isinstance(value, list):  # named templates, as transformers saves several
            value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"),
                         None)
        if value is not None and not isinstance(value, str):
            raise UsageError(f"{folder / name}: chat_template must be a Jinja template string, or a list of "
                             f"{{\"name\", \"template\"}} with a \"default\" one, not {type(value).__name__}")
        if value:
            return value
    return None


@dataclass(frozen=True)
class HFChatTemplate:
    """A folder's Jinja chat template behind `ChatTemplate`'s interface (`render`, `generation_prompt`, `stop_ids`,
    `check_tokenizer`, `special_tokens`, `answer_end`). Build it with `load_hf_chat_template`."""

    folder: str
    source: str
    image: ImageMarkers
    special_names: tuple[tuple[str, str], ...] = ()  # the folder's bos_token, eos_token, ... for the template
    answer_end: str | None = None  # the text that ends an answer (`<|im_end|>`), found by rendering one
    name: str = TOKENIZER

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The image markers, which must be (or become) tokens of the tokenizer; the template's own markers are the
        folder's tokens already."""
        return tuple(t for t in dict.fromkeys((self.image.placeholder, self.image.before, self.image.after)) if t)

    @property
    def tagged(self) -> bool:
        return bool(_GENERATION_TAG.search(self.source))

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """ValueError when the tokenizer gives no character offsets or splits the image placeholder."""
        if not hasattr(tokenizer, "encode_with_offsets"):
            raise ValueError(f"the chat template of {self.folder} needs a Hugging Face tokenizer (load_hf_tokenizer), "
                             f"which gives each token's characters; {type(tokenizer).__name__} does not")
        count = len(tokenizer.encode(self.image.placeholder))
        if count != 1:
            raise ValueError(f"the chat template of {self.folder} writes {self.image.placeholder!r} for an image, "
                             f"which the tokenizer splits into {count} tokens: it must be one")

    def render(self, turns: Sequence[Turn], image_tokens: Sequence[int], tokenizer: Tokenizer
               ) -> RenderedConversation:
        """The token ids of `turns`; the n-th image slot takes `image_tokens[n]` placeholders."""
        return self._rendered(turns, image_tokens, tokenizer, prompt=False)

    def generation_prompt(self, turns: Sequence[Turn], image_tokens: Sequence[int], tokenizer: Tokenizer
                          ) -> list[int]:
        """The token ids that ask for the next answer: `turns` rendered with the template's generation prompt. When
        the last turn is a document, the model continues it: its end-of-sequence is left off."""
        if turns and turns[-1].role == "document":
            return self.render(turns, image_tokens, tokenizer).tokens[:-1]
        return self._rendered(turns, image_tokens, tokenizer, prompt=True).tokens

    def stop_ids(self, tokenizer: Tokenizer) -> frozenset[int]:
        """The ids that end an answer: the template's end of an answer when it is one token, and end-of-sequence."""
        ends = {tokenizer.eos_id}
        end = tokenizer.encode(self.answer_end) if self.answer_end else []
        if len(end) == 1:
            ends.update(end)
        return frozenset(ends)

    # -- rendering

    def _rendered(self, turns: Sequence[Turn], image_tokens: Sequence[int], tokenizer: Tokenizer, prompt: bool
                  ) -> RenderedConversation:
        """Each run of chat turns through the template, each document as it is; `prompt`: the last run (or, with no
        chat turn, nothing) followed by the generation prompt, and nothing marked trained."""
        out = RenderedConversation([], [])
        images = iter(image_tokens)
        segments = list(_segments(turns))
        if prompt and (not segments or segments[-1][0] is None):
            segments.append(([], None))
        for n, (chat, doc) in enumerate(segments):
            if doc is not None:
                self._document(doc, images, tokenizer, out)
            elif prompt:
                text = self._render(_messages(chat), add_generation_prompt=n == len(segments) - 1)[0]
                self._tokens(text, [], sum(t.num_images for t in chat), images, tokenizer, out)
            else:
                text, spans = self._text_and_answers(_messages(chat))
                self._tokens(text, spans, sum(t.num_images for t in chat), images, tokenizer, out)
        return out

    def _render(self, messages: list[dict], add_generation_prompt: bool, track: bool = False
                ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text, and the character spans of its `{% generation %}` blocks when `track`."""
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            texts, spans = render_jinja_template(
                conversations=[messages], chat_template=self.source, return_assistant_tokens_mask=track,
                add_generation_prompt=add_generation_prompt, **dict(self.special_names))
        except Exception as err:  # jinja2's TemplateError, raise_exception(), an undefined name, ...
            if type(err).__name__ == "TemplateSyntaxError":
                raise ValueError(f"the chat template of {self.folder} cannot be read: {_first_line(err)} (line "
                                 f"{getattr(err, 'lineno', '?')})") from None
            raise ValueError(f"the chat template of {self.folder} cannot render this conversation "
                             f"({_roles(messages)}): {_first_line(err)}") from None
        return texts[0], (spans[0] if track else [])

    def _text_and_answers(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of what is trained in it."""
        if self.tagged:
            return self._render(messages, add_generation_prompt=False, track=True)
        text = self._render(messages, add_generation_prompt=False)[0]
        spans, answers = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            answers += 1
            before = self._render(messages[:i], add_generation_prompt=True)[0]
            upto = text if i == len(messages) - 1 else self._render(messages[: i + 1], add_generation_prompt=False)[0]
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ValueError(f"the chat template of {self.folder} renders the conversation before answer "
                                 f"{answers} differently once the answer follows, so the answer cannot be told "
                                 f"apart: mark the answers with {{% generation %}} tags in the template")
            start, end = len(before), len(upto)
            while start < end and upto[start].isspace():
                start += 1
            while end > start and upto[end - 1].isspace():
                end -= 1
            if end > start:
                spans.append((start, end))
        return text, spans

    def _tokens(self, text: str, spans: list[tuple[int, int]], num_images: int, images, tokenizer: Tokenizer,
                out: RenderedConversation) -> None:
        """`text` tokenized whole between its image placeholders (each one token, so the splits change nothing),
        each placeholder expanded to its image; a token is trained when its characters fall in a span."""
        pieces = text.split(self.image.placeholder)
        if len(pieces) - 1 != num_images:
            raise ValueError(f"the chat template of {self.folder} wrote "
                             f"{counted(len(pieces) - 1, repr(self.image.placeholder) + ' placeholder')} for "
                             f"{counted(num_images, 'image')}")
        base = 0
        for n, piece in enumerate(pieces):
            if n:
                self._image(next(images), tokenizer, out)
                base += len(self.image.placeholder)
            ids, offsets = tokenizer.encode_with_offsets(piece) if piece else ([], [])
            out.tokens.extend(ids)
            out.trained.extend(_in_spans(base + a, base + b, spans) for a, b in offsets)
            base += len(piece)

    def _image(self, count: int, tokenizer: Tokenizer, out: RenderedConversation) -> None:
        for marker, is_image in ((self.image.before, False), (None, True), (self.image.after, False)):
            if is_image:
                out.image_runs.append((len(out.tokens), count))
            ids = [tokenizer.image_token_id] * count if is_image else tokenizer.encode(marker) if marker else []
            out.tokens.extend(ids)
            out.trained.extend([False] * len(ids))

    def _document(self, turn: Turn, images, tokenizer: Tokenizer, out: RenderedConversation) -> None:
        """A document as the hand-written templates write it: bos, its text (trained) and images, eos (trained)."""
        if tokenizer.bos_id is not None:
            out.tokens.append(tokenizer.bos_id)
            out.trained.append(False)
        for part in turn.parts:
            if isinstance(part, ImageSlot):
                self._image(next(images), tokenizer, out)
            elif part:
                ids = tokenizer.encode(part)
                out.tokens.extend(ids)
                out.trained.extend([True] * len(ids))
        out.tokens.append(tokenizer.eos_id)
        out.trained.append(True)


def _in_spans(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    """Whether a token of characters [start, end) overlaps a span (a token of no characters: lies inside one)."""
    if start == end:
        return any(a <= start < b for a, b in spans)
    return any(start < b and a < end for a, b in spans)


def _segments(turns: Sequence[Turn]):
    """(chat turns, None) for each run of chat turns, (None, turn) for each document, in order."""
    run: list[Turn] = []
    for turn in turns:
        if turn.role == "document":
            if run:
                yield run, None
                run = []
            yield None, turn
        else:
            run.append(turn)
    if run:
        yield run, None


def _messages(turns: Sequence[Turn]) -> list[dict]:
    """Chat turns as transformers' messages: content a string, or a list of parts when the turn has images."""
    messages = []
    for turn in turns:
        if turn.num_images:
            content = [{"type": "image"} if isinstance(p, ImageSlot) else {"type": "text", "text": p}
                       for p in turn.parts]
        else:
            content = "".join(turn.parts)
        messages.append({"role": turn.role, "content": content})
    return messages


def _roles(messages: list[dict]) -> str:
    return ", ".join(m["role"] for m in messages) or "no turns"


def load_hf_chat_template(folder: str | Path, image: ImageMarkers, instead: str = "NAME") -> HFChatTemplate:
    """The chat template of the Hugging Face folder `folder` (UsageError, one line, when it has none, transformers is
    not installed, or it cannot render a question and its answer; `instead`: the hand-written template it offers)."""
    folder = str(folder)
    hint = f"choose a hand-written one with --set chat_template={instead}"
    source = template_source(folder)
    if source is None:
        raise UsageError(f"tokenizer folder {folder} has no chat template ({JINJA_FILE}, or chat_template in "
                         f"{CONFIG_FILE}): {hint}")
    try:
        import transformers.utils.chat_template_utils  # noqa: F401
    except ImportError:
        raise UsageError(f"the chat template of {folder} is rendered by transformers, which this install lacks: "
                         f"pip install 'mimo[hf]', or {hint}") from None
    named = _special_tokens_of(Path(folder))[0]
    template = HFChatTemplate(folder, source, image, tuple((k, v) for k, v in named.items() if v is not None))
    probe = [{"role": "user", "content": "Is it red?"}, {"role": "assistant", "content": _PROBE_ANSWER}]
    try:
        text, spans = template._text_and_answers(probe)
    except ValueError as err:
        raise UsageError(f"{err}: fix the template, or {hint}") from None
    answer = "".join(text[a:b] for a, b in spans)
    if _PROBE_ANSWER not in answer:
        raise UsageError(f"the chat template of {folder} trains no assistant answer: a user question and an assistant "
                         f"answer render as {text!r}, the answer not among the trained text {answer!r}")
    end = answer[answer.rindex(_PROBE_ANSWER) + len(_PROBE_ANSWER):].strip()
    return HFChatTemplate(folder, source, image, template.special_names, end or None)


def select_chat_template(name: str, tokenizer_path: str | None, *, default: str, image: ImageMarkers):
    """The `chat_template` setting's template: `tokenizer` (the tokenizer folder's own), `auto` (the folder's own when
    it has one, else `default`), or a hand-written one by name (`chat_template.CHAT_TEMPLATES`)."""
    if name == TOKENIZER and tokenizer_path is None:
        raise UsageError("chat_template=tokenizer renders the tokenizer folder's own template, but no tokenizer_path "
                         "is set: --set tokenizer_path=DIR (a Hugging Face tokenizer folder with a chat template)")
    if name == TOKENIZER or (name == AUTO and tokenizer_path is not None and Path(tokenizer_path).is_dir()
                             and template_source(tokenizer_path) is not None):
        return load_hf_chat_template(tokenizer_path, image, instead=default)
    return chat_template(default if name == AUTO else name)
