"""The image placeholder token and the optional Hugging Face tokenizer (read from local files only)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=4)
def load_tokenizer(path: str):
    from mimo.core.data import load_hf_tokenizer

    return load_hf_tokenizer(path)


def tokenizer_of(settings):
    """The settings' tokenizer, checked against the vocabulary, or None when no tokenizer_path is set."""
    if settings.tokenizer_path is None:
        return None
    tokenizer = load_tokenizer(settings.tokenizer_path)
    if tokenizer.vocab_size > settings.vocab_size:
        raise ValueError(f"the tokenizer at {settings.tokenizer_path} has {tokenizer.vocab_size} tokens, more than "
                         f"vocab_size {settings.vocab_size}")
    return tokenizer


def image_token_id(settings) -> int:
    """image_token_id if set, else the tokenizer's image token, else the last id of the vocabulary."""
    if settings.image_token_id is not None:
        return settings.image_token_id
    tokenizer = tokenizer_of(settings)
    return tokenizer.image_token_id if tokenizer is not None else settings.vocab_size - 1
