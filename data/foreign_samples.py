"""Sample classes of other frameworks that mimo reads as its own formats.

Datasets prepared for Megatron-Bridge's VLM and chat task encoders name Bridge's `ChatMLWebdataset` in
`.nv-meta/dataset.yaml` (`megatron.bridge.data.energon.task_encoder_utils`, or in older releases
`megatron.bridge.recipes.qwen_vl.data.energon.task_encoder` and `megatron.bridge.models.qwen_vl.data.energon`),
with a `field_map` onto its fields:

| field | holds | mimo reads it as |
| --- | --- | --- |
| `conversation` | the chat JSON: a list of turns (`from`/`value` or `role`/`content`, per turn), or an object with them under `conversations`, `messages` or `conversation` | the turns (`conversation.py`) |
| `imgs` | one image (`jpg`, `png`) or a list of them (`jpgs`: a pickled list of encoded images) | the images, in order |
| `videos`, `audio` | video frames, a waveform | not read: such a sample is skipped as a bad sample |
| `tools` | tool definitions for the chat template | not read |

Energon imports the class a dataset names; when its module is not installed, energon looks the class name up in
`megatron.energon` instead. Registering mimo's `ChatMLWebdataset` there (`register`) makes energon build it: it
reads the same fields into a `ChatMLRecord`, which `sample_formats.py` turns into a conversation. Where Bridge is
installed its own class loads, and its samples (the same fields) are read the same way (`reader_for`).
"""

from __future__ import annotations

import io
import json
import pickle
from typing import Any, Callable

import torch
from megatron.energon import DefaultDecoderWebdatasetFactory, Sample, edataclass

from .conversation import Conversation, place_images, turns_from_chat_json

__all__ = ["ChatMLRecord", "ChatMLWebdataset", "chatml_conversation", "foreign_note", "reader_for", "register"]

BRIDGE = "Megatron-Bridge"


@edataclass
class ChatMLRecord(Sample):
    """A sample of a dataset prepared for Megatron-Bridge's ChatML task encoders, fields as Bridge names them."""

    conversation: Any
    imgs: Any = None
    videos: Any = None
    audio: Any = None
    tools: Any = None


class ChatMLWebdataset(DefaultDecoderWebdatasetFactory[ChatMLRecord]):
    """Bridge's dataset class name, built by mimo: the field map of the dataset's yaml onto `ChatMLRecord`."""

    __sample_type__ = ChatMLRecord

    def __init__(self, path, *, image_decode_spec: str | None = None, **kwargs):
        # Bridge's own option for its image decoder; energon's default decoder (RGB tensors) serves mimo
        super().__init__(path, **kwargs)


# the class names a foreign dataset.yaml may give -> (whose it is, what mimo reads it as)
KNOWN = {"ChatMLWebdataset": (BRIDGE, "chat (conversation and imgs)")}


def foreign_note(module: str, name: str) -> str | None:
    """What mimo reads a foreign dataset class as (one phrase), or None when it does not know the class."""
    if name not in KNOWN:
        return None
    whose, what = KNOWN[name]
    return f"names {whose}'s {module}.{name}; mimo reads it as {what}"


def register() -> None:
    """Make energon build mimo's class for a known foreign class name whose module is not installed (energon's
    fallback looks the name up in `megatron.energon`); a name energon itself has is left alone."""
    import megatron.energon as energon

    for name, cls in (("ChatMLWebdataset", ChatMLWebdataset),):
        if not hasattr(energon, name):
            setattr(energon, name, cls)


def _as_turn_list(payload: Any) -> list:
    if isinstance(payload, (str, bytes, bytearray)):
        payload = json.loads(payload)
    if isinstance(payload, dict):
        for key in ("conversations", "messages", "conversation"):
            if key in payload:
                return _as_turn_list(payload[key]) if key == "conversation" else payload[key]
        raise ValueError(f"the ChatML conversation has none of 'conversations', 'messages', 'conversation'; its "
                         f"keys: {sorted(payload)}")
    if not isinstance(payload, list):
        raise ValueError(f"the ChatML conversation must be a list of turns, got {type(payload).__name__}")
    return payload


def _messages(payload: Any) -> dict:
    """The conversation as mimo's chat JSON (`messages` with role/content); either turn form, turn by turn."""
    messages = []
    for n, turn in enumerate(_as_turn_list(payload)):
        if not isinstance(turn, dict) or not ({"role", "from"} & set(turn)):
            raise ValueError(f"ChatML turn {n} must be an object with 'role' or 'from', got {turn!r}")
        messages.append({"role": turn.get("role", turn.get("from")), "content": turn.get("content", turn.get("value", ""))})
    system = payload.get("system") if isinstance(payload, dict) else None
    return {"messages": messages, **({"system": system} if isinstance(system, str) else {})}


class _PlainData(pickle.Unpickler):
    """A pickled list of encoded images holds bytes and lists only: refuse anything that would run code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"a pickled image list may hold only bytes, not {module}.{name}")


def _image(value: Any):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (bytes, bytearray)):
        from PIL import Image

        return Image.open(io.BytesIO(value)).convert("RGB")
    if hasattr(value, "convert"):  # a PIL image
        return value.convert("RGB")
    raise ValueError(f"an image of the ChatML sample is a {type(value).__name__}, not an image")


def _images(imgs: Any) -> list:
    if imgs is None:
        return []
    if isinstance(imgs, (bytes, bytearray)):  # `jpgs`: the list pickled, energon leaves it undecoded
        imgs = _PlainData(io.BytesIO(imgs)).load()
    if isinstance(imgs, torch.Tensor):
        return [imgs] if imgs.dim() == 3 else list(imgs)
    if isinstance(imgs, (list, tuple)):
        return [_image(im) for im in imgs]
    return [_image(imgs)]


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, (list, tuple)) and not value)


def chatml_conversation(sample) -> Conversation:
    """A ChatML sample (mimo's `ChatMLRecord` or Bridge's `ChatMLSample`) as a conversation; ValueError (energon
    skips the sample) for what mimo does not read."""
    for field in ("videos", "audio"):
        if _present(getattr(sample, field, None)):
            raise ValueError(f"ChatML sample {getattr(sample, '__key__', '?')} has {field}, which mimo does not read "
                             f"(it reads images)")
    images = _images(getattr(sample, "imgs", None))
    turns = place_images(turns_from_chat_json(_messages(sample.conversation)), len(images))
    return Conversation(turns, images)


def reader_for(sample_type: type) -> Callable | None:
    """How samples of a foreign class are read, for a foreign sample class mimo knows (Bridge's own, where Bridge
    is installed); None otherwise."""
    if sample_type.__name__ == "ChatMLSample" and sample_type.__module__.startswith("megatron.bridge"):
        return chatml_conversation
    return None
