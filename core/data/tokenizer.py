"""Tokenizers behind one small interface: a self-contained byte-level tokenizer for tests and smoke runs, and a
wrapper around a Hugging Face tokenizer loaded from local files (only when `transformers` is installed).

The interface (`Tokenizer`): `encode(text) -> list[int]` (no special tokens added), `decode(ids) -> str`,
`vocab_size`, `pad_id`, `bos_id`, `eos_id`, `image_token_id`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Protocol, runtime_checkable

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
    """UTF-8 bytes as ids 0..255, then the special tokens: pad 256, bos 257, eos 258, image 259.

    `vocab_size` is 260 unless a larger one is asked for (e.g. to match a model's embedding table); the extra ids
    are never produced. `decode` drops special tokens and ids it does not know, and replaces invalid UTF-8.
    """

    NUM_BYTES = 256

    def __init__(self, vocab_size: int | None = None):
        self.pad_id = self.NUM_BYTES
        self.bos_id = self.NUM_BYTES + 1
        self.eos_id = self.NUM_BYTES + 2
        self.image_token_id = self.NUM_BYTES + 3
        minimum = self.NUM_BYTES + 4
        if vocab_size is not None and vocab_size < minimum:
            raise ValueError(f"ByteTokenizer needs vocab_size >= {minimum}, got {vocab_size}")
        self.vocab_size = vocab_size or minimum

    @property
    def special_ids(self) -> dict[str, int]:
        return {"pad": self.pad_id, "bos": self.bos_id, "eos": self.eos_id, "image": self.image_token_id}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < self.NUM_BYTES).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


class HFTokenizer:
    """A Hugging Face tokenizer behind the `Tokenizer` interface.

    The image placeholder is `image_token` (added as a special token when the vocabulary lacks it); pad falls back
    to eos when the tokenizer defines no pad token. `vocab_size` counts added tokens (`len(tokenizer)`).
    """

    def __init__(self, hf_tokenizer, image_token: str = "<image>"):
        self.hf = hf_tokenizer
        if hf_tokenizer.convert_tokens_to_ids(image_token) in (None, hf_tokenizer.unk_token_id):
            hf_tokenizer.add_special_tokens({"additional_special_tokens": [image_token]})
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

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size})"


def load_hf_tokenizer(local_dir: str | Path, image_token: str = "<image>", **kwargs) -> HFTokenizer:
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
    return HFTokenizer(AutoTokenizer.from_pretrained(str(local_dir), **kwargs), image_token=image_token)
