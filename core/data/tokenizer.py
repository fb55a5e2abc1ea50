"""Tokenizers behind one small interface: a self-contained byte-level tokenizer for tests and smoke runs, and a
wrapper around a Hugging Face tokenizer loaded from local files (only when `transformers` is installed).

The interface (`Tokenizer`): `encode(text) -> list[int]` (no special tokens added; a chat template's markers such
as `<|im_start|>` become their one id), `decode(ids) -> str`, `vocab_size`, `pad_id`, `bos_id`, `eos_id`,
`image_token_id`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Protocol, Sequence, runtime_checkable

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_hf_tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int
    image_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then the special tokens: pad 256, bos 257, eos 258, then `special_tokens` (e.g.
    a chat template's `<|im_start|>`, one id each, in order), and the image placeholder last: 259 without
    `special_tokens`.

    `vocab_size` is that minimum unless a larger one is asked for (e.g. to match a model's embedding table); the
    extra ids are never produced. `decode` drops special tokens (unless `skip_special_tokens=False`, which writes
    them as text) and ids it does not know, and replaces invalid UTF-8.
    """

    NUM_BYTES = 256

    def __init__(self, vocab_size: int | None = None, special_tokens: Sequence[str] = ()):
        self.pad_id = self.NUM_BYTES
        self.bos_id = self.NUM_BYTES + 1
        self.eos_id = self.NUM_BYTES + 2
        self.extra_ids = {text: self.NUM_BYTES + 3 + i for i, text in enumerate(dict.fromkeys(special_tokens))}
        self.image_token_id = self.NUM_BYTES + 3 + len(self.extra_ids)
        minimum = self.image_token_id + 1
        if vocab_size is not None and vocab_size < minimum:
            raise ValueError(f"ByteTokenizer needs vocab_size >= {minimum}, got {vocab_size}")
        self.vocab_size = vocab_size or minimum
        # longest first, so that a marker that contains another one wins
        markers = sorted(self.extra_ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, markers)) + ")") if markers else None

    @property
    def special_ids(self) -> dict[str, int]:
        return {"pad": self.pad_id, "bos": self.bos_id, "eos": self.eos_id, "image": self.image_token_id,
                **self.extra_ids}

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        for piece in self._split.split(text):
            ids += [self.extra_ids[piece]] if piece in self.extra_ids else list(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        names = {} if skip_special_tokens else {
            self.pad_id: "<pad>", self.bos_id: "<s>", self.eos_id: "</s>", self.image_token_id: "<image>",
            **{i: text for text, i in self.extra_ids.items()}}
        out, run = [], bytearray()
        for i in map(int, ids):
            if 0 <= i < self.NUM_BYTES:
                run.append(i)
            elif i in names:
                out += [run.decode("utf-8", errors="replace"), names[i]]
                run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


class HFTokenizer:
    """A Hugging Face tokenizer behind the `Tokenizer` interface.

    The image placeholder is `image_token`; it and `special_tokens` (a chat template's markers) are added as special
    tokens when the vocabulary lacks them. Pad falls back to eos when the tokenizer defines no pad token.
    `vocab_size` counts added tokens (`len(tokenizer)`).
    """

    def __init__(self, hf_tokenizer, image_token: str = "<image>", special_tokens: Sequence[str] = ()):
        self.hf = hf_tokenizer
        missing = [t for t in dict.fromkeys([image_token, *special_tokens])
                   if hf_tokenizer.convert_tokens_to_ids(t) in (None, hf_tokenizer.unk_token_id)]
        if missing:
            hf_tokenizer.add_special_tokens({"additional_special_tokens": missing})
        self.image_token = image_token
        self.image_token_id = int(hf_tokenizer.convert_tokens_to_ids(image_token))
        if hf_tokenizer.eos_token_id is None:
            raise ValueError("the Hugging Face tokenizer defines no eos token")
        self.eos_id = int(hf_tokenizer.eos_token_id)
        self.bos_id = None if hf_tokenizer.bos_token_id is None else int(hf_tokenizer.bos_token_id)
        self.pad_id = int(hf_tokenizer.pad_token_id) if hf_tokenizer.pad_token_id is not None else self.eos_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size})"


def load_hf_tokenizer(local_dir: str | Path, image_token: str = "<image>", special_tokens: Sequence[str] = (),
                      **kwargs) -> HFTokenizer:
    """Load `transformers.AutoTokenizer` from files in `local_dir` (never from the network)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(
            "loading a Hugging Face tokenizer needs the `transformers` package, which is not installed "
            "(pip install transformers); for tests and smoke runs use mimo.core.data.tokenizer.ByteTokenizer"
        ) from e
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise FileNotFoundError(f"tokenizer directory {local_dir} does not exist")
    kwargs.setdefault("local_files_only", True)
    return HFTokenizer(AutoTokenizer.from_pretrained(str(local_dir), **kwargs), image_token=image_token,
                       special_tokens=special_tokens)
