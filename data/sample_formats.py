"""The energon sample types mimo reads, each turned into a `Conversation` (see `conversation.py`).

| sample type | conversation |
| --- | --- |
| `CaptioningSample` | user: the image; assistant: the caption |
| `VQASample` | user: the image and the question (`context`); assistant: the answer (the highest-weighted one) |
| `MultiChoiceVQASample` | user: the image, the question and the lettered choices; assistant: the correct choice |
| `SimilarityInterleavedSample` | a document: the texts in order, each image before the text it is matched to |
| `InterleavedSample` | a document: its sequence of texts and images, in order |
| `TextSample` | a document: the text |
| crude chat (`CrudeWebdataset`, cooked by `chat_cooker.py`) | the conversation's turns |
| Megatron-Bridge's `ChatMLWebdataset` (`foreign_samples.py`) | the conversation's turns and `imgs` |

`<image>` placeholders in a question or text place the image there (else it comes first). A sample type not in
the table is refused before training starts (`check_readable`), in one line naming it and the types read here.
"""

from __future__ import annotations

from typing import Callable

from megatron.energon import (
    CaptioningSample, CrudeSample, InterleavedSample, MultiChoiceVQASample, SimilarityInterleavedSample, TextSample,
    VQASample,
)

from mimo.errors import UsageError
from mimo.wording import counted

from . import foreign_samples
from .chat_cooker import ChatSample
from .conversation import IMAGE, Conversation, Turn, place_images, split_placeholders
from .foreign_samples import ChatMLRecord, chatml_conversation

__all__ = ["READERS", "check_readable", "conversation_of", "kind_of", "readable_type_names"]


def _key(sample) -> str:
    return getattr(sample, "__key__", "?")


def _prompt(image, text: str) -> Conversation:
    """One user turn with `text` and the image (at its placeholder, else first)."""
    turns = place_images([Turn("user", tuple(split_placeholders(text)))], 1 if image is not None else 0)
    return Conversation(turns, [image] if image is not None else [])


def captioning(sample: CaptioningSample) -> Conversation:
    return Conversation([Turn("user", (IMAGE,)), Turn("assistant", (sample.caption,))], [sample.image])


def vqa(sample: VQASample) -> Conversation:
    if not sample.answers:
        raise ValueError(f"VQASample {_key(sample)} has no answer to train on")
    best = 0
    if sample.answer_weights is not None and len(sample.answer_weights) == len(sample.answers):
        best = int(max(range(len(sample.answers)), key=lambda i: float(sample.answer_weights[i])))
    prompt = _prompt(sample.image, sample.context)
    return Conversation(prompt.turns + [Turn("assistant", (sample.answers[best],))], prompt.images)


def multi_choice_vqa(sample: MultiChoiceVQASample) -> Conversation:
    choices = list(sample.choices or [])
    if not 0 <= sample.correct_choice_idx < len(choices):
        raise ValueError(f"MultiChoiceVQASample {_key(sample)}: correct_choice_idx {sample.correct_choice_idx} "
                         f"is not one of its {counted(len(choices), 'choice')}")
    letters = [chr(ord("A") + i) for i in range(len(choices))]
    options = "".join(f"\n{letter}. {choice}" for letter, choice in zip(letters, choices))
    prompt = _prompt(sample.image, sample.context + options)
    answer = f"{letters[sample.correct_choice_idx]}. {choices[sample.correct_choice_idx]}"
    return Conversation(prompt.turns + [Turn("assistant", (answer,))], prompt.images)


def similarity_interleaved(sample: SimilarityInterleavedSample) -> Conversation:
    texts, images = list(sample.texts), list(sample.images)
    matched = list(sample.matched_text_indices) if sample.matched_text_indices is not None else [0] * len(images)
    if len(matched) != len(images) or any(not 0 <= m < max(len(texts), 1) for m in matched):
        raise ValueError(f"SimilarityInterleavedSample {_key(sample)}: matched_text_indices {matched} do not match "
                         f"its {counted(len(images), 'image')} and {counted(len(texts), 'text')}")
    parts: list = []
    order: list = []
    for t in range(max(len(texts), 1)):
        for i in (i for i, m in enumerate(matched) if m == t):  # an image comes before the text it is matched to
            parts.append(IMAGE)
            order.append(images[i])
        if t < len(texts):
            parts += split_placeholders(texts[t] if t == len(texts) - 1 else texts[t] + " ")
    return Conversation([Turn("document", tuple(parts))], order)


def interleaved(sample: InterleavedSample) -> Conversation:
    parts, images = [], []
    for item in sample.sequence:
        if isinstance(item, str):
            parts += split_placeholders(item)
        else:
            parts.append(IMAGE)
            images.append(item)
    return Conversation([Turn("document", tuple(parts))], images)


def text(sample: TextSample) -> Conversation:
    return Conversation([Turn("document", tuple(split_placeholders(sample.text)))])


def chat(sample: ChatSample) -> Conversation:
    return sample.conversation()


# The sample type a dataset declares -> how its samples become conversations. A crude dataset's samples are
# cooked into ChatSamples first.
READERS: dict[type, Callable] = {
    CaptioningSample: captioning, VQASample: vqa, MultiChoiceVQASample: multi_choice_vqa,
    SimilarityInterleavedSample: similarity_interleaved, InterleavedSample: interleaved, TextSample: text,
    ChatSample: chat, ChatMLRecord: chatml_conversation,
}
_DECLARED = {**{t: t.__name__ for t in READERS if t not in (ChatSample, ChatMLRecord)},
             CrudeSample: "CrudeWebdataset (chat)", ChatMLRecord: "ChatMLWebdataset (Megatron-Bridge chat)"}
foreign_samples.register()  # before any dataset is opened: energon then builds mimo's class for Bridge's name


# What each sample type is called where a dataset is described (docs/data.md's example names).
_KINDS = {CaptioningSample: "captions", VQASample: "vqa", MultiChoiceVQASample: "multiple choice",
          SimilarityInterleavedSample: "interleaved", InterleavedSample: "sequence", TextSample: "text",
          ChatSample: "chat", ChatMLRecord: "bridge chat"}


def kind_of(sample) -> str:
    """The format a read sample is in: `captions`, `vqa`, ..., `chat` (else its class name)."""
    return next((kind for t, kind in _KINDS.items() if isinstance(sample, t)), type(sample).__name__)


def readable_type_names() -> list[str]:
    return list(_DECLARED.values())


def conversation_of(sample) -> Conversation:
    for sample_type, read in READERS.items():
        if isinstance(sample, sample_type):
            return read(sample)
    if read := foreign_samples.reader_for(type(sample)):
        return read(sample)
    raise ValueError(f"sample {_key(sample)} is a {type(sample).__name__}, which mimo does not read "
                     f"(it reads {', '.join(readable_type_names())})")


def check_readable(sample_type: type, path, reader: str = "this provider") -> None:
    """UsageError unless samples a dataset declares as `sample_type` can be read."""
    if sample_type in _DECLARED or foreign_samples.reader_for(sample_type):
        return
    raise UsageError(f"--data {path}: {reader} cannot read {sample_type.__name__} samples; it reads "
                     f"{', '.join(readable_type_names())} (see docs/data.md)")
