"""Multi-turn chat in crude webdatasets: the cooker mimo registers with energon.

A crude webdataset (`energon prepare DIR --non-interactive --split-ratio 1,0,0 --sample-type CrudeWebdataset`)
hands each sample over as a dict of its parts, decoded by extension. A chat sample has:

* one JSON part (`<key>.json`) with the conversation in either common form (see `conversation.py`);
* any number of images (`<key>.jpg`, or `<key>.0.png`, `<key>.1.jpg`, ... for several). Their order is the JSON's
  `images` list when it names the sample's image parts (e.g. `"images": ["0.png", "1.jpg"]`), otherwise the
  parts' names in natural order (`img2` before `img10`). A text-only sample has none.

`cook_chat` turns it into a `ChatSample` (turns and images); a sample without a usable JSON part, or whose
`<image>` placeholders do not match its images, raises `ValueError` and energon skips it as a bad sample.
"""

from __future__ import annotations

import io
import re
from typing import Any

import torch
from megatron.energon import Cooker, Sample, basic_sample_keys, edataclass, stateless

from .conversation import Conversation, place_images, turns_from_chat_json

__all__ = ["CHAT_COOKER", "IMAGE_EXTENSIONS", "ChatSample", "cook_chat"]

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "ppm", "pgm", "pbm", "pnm", "gif")


@edataclass
class ChatSample(Sample):
    """A cooked chat sample: its turns (`conversation.Turn`) and images, one per IMAGE slot, in slot order."""

    turns: list
    images: list

    def conversation(self) -> Conversation:
        return Conversation(list(self.turns), list(self.images))


def _natural(name: str) -> list:
    return [int(piece) if piece.isdigit() else piece for piece in re.split(r"(\d+)", name)]


def _image_parts(crude: dict) -> list[str]:
    return [name for name in crude if not name.startswith("__")
            and name.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS]


def _as_image(value: Any, name: str):
    """energon decodes the usual formats to tensors; others (e.g. webp) arrive as bytes and PIL opens them."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (bytes, bytearray)):
        from PIL import Image

        return Image.open(io.BytesIO(value)).convert("RGB")
    raise ValueError(f"image part '{name}' decoded to {type(value).__name__}, not an image")


def _json_part(crude: dict) -> Any:
    names = [name for name in crude if not name.startswith("__") and name.rsplit(".", 1)[-1].lower() == "json"]
    if len(names) != 1:
        parts = sorted(name for name in crude if not name.startswith("__"))
        raise ValueError(f"a chat sample needs exactly one .json part with the conversation; it has parts {parts}")
    return crude[names[0]]


@stateless
def cook_chat(crude: dict) -> ChatSample:
    """The ChatSample of a crude webdataset sample (see the module docstring)."""
    data = _json_part(crude)
    images = _image_parts(crude)
    named = data.get("images") if isinstance(data, dict) else None
    if isinstance(named, list) and named and sorted(map(str, named)) == sorted(images):
        order = [str(name) for name in named]
    else:
        order = sorted(images, key=_natural)
    turns = place_images(turns_from_chat_json(data), len(order))
    return ChatSample(**basic_sample_keys(crude), turns=turns, images=[_as_image(crude[n], n) for n in order])


CHAT_COOKER = Cooker(cook_chat)
