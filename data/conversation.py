"""Conversations: the one form every accepted sample takes before a chat template tokenizes it.

A conversation is a list of turns and the sample's images. A turn has a role and parts: text, and one `IMAGE` slot
per image, in the order the images come. Roles:

* `system`, `user`: the prompt (never trained on);
* `assistant`: the answer (trained on);
* `document`: text trained on as it is, without the chat template's turn markers (interleaved web documents,
  plain text).

Chat JSON in the two common forms becomes turns here (`turns_from_chat_json`):

* LLaVA / ShareGPT: `{"conversations": [{"from": "human" | "gpt" | "system", "value": "..."}], "system"?: "..."}`;
* OpenAI / Hugging Face: `{"messages": [{"role": "system" | "user" | "assistant", "content": "..." | [parts]}]}`,
  where a list of parts holds `{"type": "text", "text": "..."}` and `{"type": "image"}` entries.

`<image>` in any text marks where an image goes; a sample whose text has none gets its images at the start of
the first user turn (LLaVA's convention). A sample whose placeholders and images differ in number is refused
(`ValueError`: energon then skips it as a bad sample).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from mimo.wording import counted

__all__ = ["IMAGE", "IMAGE_PLACEHOLDER", "ROLES", "Conversation", "ImageSlot", "Turn", "place_images",
           "split_placeholders", "turns_from_chat_json"]

IMAGE_PLACEHOLDER = "<image>"
ROLES = ("system", "user", "assistant", "document")

# The role names of chat datasets, by what they mean here.
_ROLE_NAMES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "bot": "assistant", "chatgpt": "assistant",
}


@dataclass(frozen=True)
class ImageSlot:
    """Where the next image of the conversation goes."""


IMAGE = ImageSlot()


@dataclass(frozen=True)
class Turn:
    role: str
    parts: tuple = ()  # str and ImageSlot, in order

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"unknown turn role {self.role!r} (roles: {', '.join(ROLES)})")

    @property
    def num_images(self) -> int:
        return sum(isinstance(p, ImageSlot) for p in self.parts)


@dataclass
class Conversation:
    turns: list[Turn]
    images: list = field(default_factory=list)  # one per IMAGE slot, in slot order

    def __post_init__(self):
        slots = sum(t.num_images for t in self.turns)
        if slots != len(self.images):
            raise ValueError(f"the conversation has {counted(slots, 'image slot')} but "
                             f"{counted(len(self.images), 'image')}")


def split_placeholders(text: str) -> list:
    """`text` as parts: its pieces between `<image>` placeholders (empty ones dropped) and an IMAGE for each."""
    parts: list = []
    for i, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i:
            parts.append(IMAGE)
        if piece:
            parts.append(piece)
    return parts


def place_images(turns: Sequence[Turn], num_images: int) -> list[Turn]:
    """The turns with their image slots checked against `num_images`: unchanged when the counts agree; with all
    the images at the start of the first user (else first) turn when the text has no placeholder."""
    turns = list(turns)
    slots = sum(t.num_images for t in turns)
    if slots == num_images:
        return turns
    if slots:
        raise ValueError(f"the text has {counted(slots, IMAGE_PLACEHOLDER + ' placeholder')} but the sample has "
                         f"{counted(num_images, 'image')}")
    if not turns:
        return [Turn("user", (IMAGE,) * num_images)]
    first = next((i for i, t in enumerate(turns) if t.role == "user"), 0)
    turns[first] = Turn(turns[first].role, (IMAGE,) * num_images + turns[first].parts)
    return turns


def _content_parts(content: Any, where: str) -> list:
    if isinstance(content, str):
        return split_placeholders(content)
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be a string or a list of parts, got {type(content).__name__}")
    parts: list = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts += split_placeholders(str(part.get("text", "")))
        elif kind in ("image", "image_url"):
            parts.append(IMAGE)
        else:
            raise ValueError(f"{where}: a content part must be {{'type': 'text' | 'image', ...}}, got {part!r}")
    return parts


def _turn(role: Any, content: Any, where: str) -> Turn:
    name = _ROLE_NAMES.get(str(role).lower()) if isinstance(role, str) else None
    if name is None:
        raise ValueError(f"{where}: unknown role {role!r} (known: {', '.join(sorted(_ROLE_NAMES))})")
    return Turn(name, tuple(_content_parts(content, where)))


def turns_from_chat_json(data: Any) -> list[Turn]:
    """The turns of a chat sample's JSON in either common form (see the module docstring)."""
    if not isinstance(data, dict):
        raise ValueError(f"the chat JSON must be an object, got {type(data).__name__}")
    turns: list[Turn] = []
    if isinstance(data.get("system"), str) and data["system"]:
        turns.append(Turn("system", tuple(split_placeholders(data["system"]))))
    if "conversations" in data:
        messages, role_key, content_key = data["conversations"], "from", "value"
    elif "messages" in data:
        messages, role_key, content_key = data["messages"], "role", "content"
    else:
        raise ValueError(f"the chat JSON has neither 'conversations' (from/value) nor 'messages' (role/content); "
                         f"its keys: {sorted(data)}")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"the chat JSON's '{'conversations' if role_key == 'from' else 'messages'}' must be a "
                         f"non-empty list")
    for n, message in enumerate(messages):
        where = f"message {n}"
        if not isinstance(message, dict) or role_key not in message or content_key not in message:
            raise ValueError(f"{where} must be an object with '{role_key}' and '{content_key}', got {message!r}")
        turns.append(_turn(message[role_key], message[content_key], where))
    return turns
