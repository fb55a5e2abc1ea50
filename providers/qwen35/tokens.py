"""The image placeholder, the chat template and the tokenizer of the Qwen3.5 family: a Hugging Face tokenizer folder
(`tokenizer_path`, with its own ChatML Jinja template where it has one) or UTF-8 bytes with the template's markers.
Qwen's template writes an image as `<|vision_start|><|image_pad|><|vision_end|>`: the `<|image_pad|>` is repeated
once per merged image token in place."""

from __future__ import annotations

import copy
from functools import lru_cache

from mimo.errors import UsageError

from .settings import Qwen35Settings

IMAGE_PAD = "<|image_pad|>"


def template_of(s: Qwen35Settings):
    from mimo.plugins.data import ImageMarkers, select_chat_template

    return select_chat_template(s.chat_template, s.tokenizer_path, default="plain", image=ImageMarkers(IMAGE_PAD))


@lru_cache(maxsize=4)
def _hf_tokenizer(path: str, special_tokens: tuple[str, ...]):
    from mimo.plugins.data import load_hf_tokenizer

    return load_hf_tokenizer(path, image_token=IMAGE_PAD, special_tokens=special_tokens)


def tokenizer_of(s: Qwen35Settings):
    """The `tokenizer_path` tokenizer (its ids checked against vocab_size), or None without one."""
    if s.tokenizer_path is None:
        return None
    tokenizer = _hf_tokenizer(s.tokenizer_path, tuple(template_of(s).special_tokens))
    if tokenizer.vocab_size > s.vocab_size:
        raise UsageError(f"the tokenizer at {s.tokenizer_path} take {tokenizer.vocab_size} token ids, more than "
                         f"vocab_size {s.vocab_size}: --set vocab_size={tokenizer.vocab_size} or more, or --set "
                         f"tokenizer_path=DIR")
    return tokenizer


def image_token_id(s: Qwen35Settings) -> int:
    """image_token_id if set, else the tokenizer's <|image_pad|>, else the vocabulary's last id."""
    if s.image_token_id is not None:
        return s.image_token_id
    tokenizer = tokenizer_of(s)
    return tokenizer.image_token_id if tokenizer is not None else s.vocab_size - 1


def data_tokenizer(s: Qwen35Settings):
    """The tokenizer prompts and `--data` are read with (the folder's, else UTF-8 bytes sized to the vocabulary),
    its image placeholder the model's."""
    from mimo.plugins.data import ByteTokenizer

    template = template_of(s)
    tokenizer = tokenizer_of(s)
    if tokenizer is None:
        needed = ByteTokenizer(special_tokens=template.special_tokens).vocab_size
        if needed > s.vocab_size:
            raise UsageError(f"UTF-8 bytes take {needed} token ids, more than vocab_size {s.vocab_size}: --set "
                             f"vocab_size={needed} or more, or --set tokenizer_path=DIR")
        tokenizer = ByteTokenizer(vocab_size=s.vocab_size, special_tokens=template.special_tokens)
        if image_token_id(s) < needed - 1:
            raise UsageError(f"image_token_id {image_token_id(s)} is one of the byte tokenizer's ids (bytes and "
                             f"markers take 0-{needed - 2}): choose one from {needed - 1} to {s.vocab_size - 1}")
    tokenizer = copy.copy(tokenizer)  # the cached tokenizer keeps its own placeholder
    tokenizer.image_token_id = image_token_id(s)
    template.check_tokenizer(tokenizer)
    return tokenizer
