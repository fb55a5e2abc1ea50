"""The image placeholder token, the chat template and the tokenizers: a Hugging Face tokenizer folder (its
tokenizer.json read with the `tokenizers` library, local files only, with the chat template's markers; its own
Jinja chat template where it has one), or UTF-8 bytes for `--data` when none is set."""

from __future__ import annotations

import copy
from functools import lru_cache

from mimo.errors import UsageError


@lru_cache(maxsize=4)
def load_tokenizer(path: str, special_tokens: tuple[str, ...] = ()):
    from mimo.plugins.data import load_hf_tokenizer

    return load_hf_tokenizer(path, special_tokens=special_tokens)


def template_of(settings):
    """The `chat_template` setting's template: with `auto`, the tokenizer folder's own Jinja template where it has one
    (its image part written `<image>`, as the Nemotron processor's template does, and expanded to `<img>`, the
    image's placeholders and `</img>`), else the hand-written Nemotron VL format."""
    from mimo.plugins.data import ImageMarkers, select_chat_template

    return select_chat_template(settings.chat_template, settings.tokenizer_path, default="nemotron",
                                image=ImageMarkers("<image>", "<img>", "</img>"))


def tokenizer_of(settings):
    """The settings' tokenizer, checked against the vocabulary, or None when no tokenizer_path is set."""
    if settings.tokenizer_path is None:
        return None
    tokenizer = load_tokenizer(settings.tokenizer_path, template_of(settings).special_tokens)
    if tokenizer.vocab_size > settings.vocab_size:
        raise UsageError(f"the tokenizer at {settings.tokenizer_path} has {tokenizer.vocab_size} token ids (the "
                         f"chat template's markers and <image> included), more than vocab_size "
                         f"{settings.vocab_size}: --set vocab_size={tokenizer.vocab_size} or more")
    return tokenizer


def image_token_id(settings) -> int:
    """image_token_id if set, else the tokenizer's image token, else the last id of the vocabulary."""
    if settings.image_token_id is not None:
        return settings.image_token_id
    tokenizer = tokenizer_of(settings)
    return tokenizer.image_token_id if tokenizer is not None else settings.vocab_size - 1


def data_tokenizer(settings):
    """The tokenizer `--data` is read with: the Hugging Face one, else bytes with the chat template's markers; its
    image placeholder is the model's (`image_token_id`)."""
    from mimo.plugins.data import ByteTokenizer

    template = template_of(settings)
    tokenizer = tokenizer_of(settings)
    if tokenizer is None:
        needed = ByteTokenizer(special_tokens=template.special_tokens).vocab_size
        if settings.vocab_size < needed:
            raise UsageError(f"without tokenizer_path, --data is read as UTF-8 bytes, which with the {template.name} "
                             f"chat template needs vocab_size >= {needed} (it is {settings.vocab_size}): --set "
                             f"vocab_size={needed}, or --set tokenizer_path=DIR (a Hugging Face tokenizer folder)")
        tokenizer = ByteTokenizer(vocab_size=settings.vocab_size, special_tokens=template.special_tokens)
        if image_token_id(settings) < needed - 1:
            raise UsageError(f"image_token_id {image_token_id(settings)} is one of the byte tokenizer's ids (bytes "
                             f"and markers take 0-{needed - 2}): choose one from {needed - 1} to "
                             f"{settings.vocab_size - 1}")
    tokenizer = copy.copy(tokenizer)  # the cached tokenizer keeps its own placeholder
    tokenizer.image_token_id = image_token_id(settings)
    return tokenizer
