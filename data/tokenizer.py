"""Tokenizers behind one small interface: a self-contained byte-level tokenizer for tests and smoke runs, a Hugging
Face tokenizer folder read with the `tokenizers` library (`load_hf_tokenizer`), and a wrapper for a `transformers`
tokenizer object one already has.

The interface (`Tokenizer`): `encode(text) -> list[int]` (no special tokens added; a chat template's markers such
as `<|im_start|>` become their one id), `decode(ids) -> str`, `vocab_size`, `pad_id`, `bos_id`, `eos_id`,
`image_token_id`. The Hugging Face ones also give each token's characters (`encode_with_offsets`), which a
folder's own chat template needs (`hf_chat_template.py`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Protocol, Sequence, runtime_checkable

from mimo.errors import UsageError

__all__ = ["ByteTokenizer", "HFFastTokenizer", "HFTokenizer", "Tokenizer", "load_hf_tokenizer"]


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
    """A `transformers` tokenizer object behind the `Tokenizer` interface (a folder needs no `transformers`: see
    `load_hf_tokenizer`).

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

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` and each one's characters [start, end) in it (a fast tokenizer's offsets)."""
        encoding = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoding["input_ids"]), [tuple(o) for o in encoding["offset_mapping"]]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size})"


TOKENIZER_FILE = "tokenizer.json"  # the `tokenizers` serialization every fast tokenizer folder holds
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"  # transformers 4 writes it; read only where transformers does
# transformers' named special tokens (`SPECIAL_TOKENS_ATTRIBUTES`)
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class HFFastTokenizer:
    """A Hugging Face fast tokenizer (a `tokenizers.Tokenizer`) behind the `Tokenizer` interface.

    eos, bos and pad are given by name (pad falls back to eos, bos may be None). They, the image placeholder
    `image_token` and `special_tokens` (a chat template's markers) become special added tokens where the tokenizer
    does not have them as added tokens yet, so that each is one id wherever it appears in a text; a token already in
    the vocabulary keeps its id; new ids follow in that order, the image placeholder last. `vocab_size` is the
    largest id + 1, added tokens included: the rows the model's embedding needs. `decode` drops special tokens
    unless `skip_special_tokens=False`.
    """

    def __init__(self, backend, eos_token: str, bos_token: str | None = None, pad_token: str | None = None,
                 image_token: str = "<image>", special_tokens: Sequence[str] = ()):
        _add_special_tokens(backend, [eos_token, bos_token, pad_token, *special_tokens, image_token])
        # a tokenizer.json may ask for padding or truncation; encoding a piece of a conversation needs neither
        backend.no_padding()
        backend.no_truncation()
        self.backend = backend
        self.image_token = image_token
        self.image_token_id = backend.token_to_id(image_token)
        self.eos_id = backend.token_to_id(eos_token)
        self.bos_id = None if bos_token is None else backend.token_to_id(bos_token)
        self.pad_id = self.eos_id if pad_token is None else backend.token_to_id(pad_token)
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` and each one's characters [start, end) in it (a chat template's trained spans)."""
        encoding = self.backend.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"HFFastTokenizer({type(self.backend.model).__name__}, vocab_size={self.vocab_size})"


def _add_special_tokens(backend, tokens: Iterable[str | None]) -> None:
    """Make each token a special added token unless it is an added token already (as transformers does)."""
    from tokenizers import AddedToken

    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = [t for t in dict.fromkeys(tokens) if t is not None and t not in added]
    if missing:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


def load_hf_tokenizer(local_dir: str | Path, image_token: str = "<image>",
                      special_tokens: Sequence[str] = ()) -> HFFastTokenizer:
    """The Hugging Face tokenizer saved in the folder `local_dir`, read with the `tokenizers` library (never from
    the network; `transformers` is not needed): `tokenizer.json`; `tokenizer_config.json` for the named special
    tokens (eos required), extra special tokens and added tokens (`added_tokens_decoder`); `special_tokens_map.json`
    where transformers reads it. Special and added tokens that tokenizer.json lacks are added, as transformers
    does. A folder that cannot be read is one UsageError line."""
    from tokenizers import Tokenizer as Backend

    folder = Path(local_dir)
    if not folder.is_dir():
        raise UsageError(f"tokenizer folder {folder} does not exist")
    if not (folder / TOKENIZER_FILE).is_file():
        raise UsageError(f"tokenizer folder {folder} has no {TOKENIZER_FILE}, the file a Hugging Face fast tokenizer "
                         f"is read from: save the tokenizer with transformers, AutoTokenizer.from_pretrained(NAME)"
                         f".save_pretrained(FOLDER), which writes it for every fast tokenizer")
    try:
        backend = Backend.from_file(str(folder / TOKENIZER_FILE))
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
        raise UsageError(f"{folder / TOKENIZER_FILE} is not a tokenizers file: {_first_line(err)}") from None
    named, extra, added_tokens = _special_tokens_of(folder)
    if named["eos_token"] is None:
        raise UsageError(f"tokenizer folder {folder}: {CONFIG_FILE} names no eos_token (the end-of-sequence token "
                         f"that ends documents and answers): add one, e.g. \"eos_token\": \"</s>\"")
    known = {t.content for t in backend.get_added_tokens_decoder().values()}
    for token in added_tokens:  # in id order, so that new ids follow the listing
        if token.content not in known:
            (backend.add_special_tokens if token.special else backend.add_tokens)([token])
    _add_special_tokens(backend, [*named.values(), *extra])
    return HFFastTokenizer(backend, eos_token=named["eos_token"], bos_token=named["bos_token"],
                           pad_token=named["pad_token"], image_token=image_token, special_tokens=special_tokens)


def _special_tokens_of(folder: Path):
    """(named special tokens by key, extra special tokens, added tokens in id order) as transformers reads them."""
    from tokenizers import AddedToken

    config_path = folder / CONFIG_FILE
    config = _read_json_object(config_path)
    named = {key: _token_content(config.get(key), config_path, key) for key in NAMED_SPECIAL_TOKENS}
    extra = _extra_special_tokens(config, config_path)
    listing = config.get("added_tokens_decoder")
    # transformers reads special_tokens_map.json only for a config without added_tokens_decoder (which 4.34 to 4.x
    # write, and then the map is stale), and its entries override the config's
    map_path = folder / SPECIAL_TOKENS_MAP_FILE
    if listing is None and map_path.is_file():
        overrides = _read_json_object(map_path)
        named.update({key: _token_content(overrides[key], map_path, key) for key in NAMED_SPECIAL_TOKENS
                      if key in overrides})
        extra += [t for t in _extra_special_tokens(overrides, map_path) if t not in extra]
    if not isinstance(listing or {}, dict) or not all(str(i).isdigit() for i in listing or {}):
        raise UsageError(f"{config_path}: added_tokens_decoder must map token ids to tokens")
    added = []
    for index, entry in sorted((listing or {}).items(), key=lambda item: int(item[0])):
        fields = {key: entry[key] for key in ADDED_TOKEN_FIELDS if key in entry} if isinstance(entry, dict) else {}
        try:
            if not isinstance(fields.get("content"), str):
                raise TypeError("no content")
            added.append(AddedToken(**fields))
        except TypeError:  # no content, or a flag that is not a boolean
            raise UsageError(f"{config_path}: added_tokens_decoder entry {index} must be an object with a "
                             f"\"content\" string and boolean flags, not {entry!r}") from None
    return named, extra, added


ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _read_json_object(path: Path) -> dict:
    """The JSON object in `path`, or {} when there is no such file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"{path} cannot be read as JSON: {_first_line(err)}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _token_content(value, path: Path, key: str) -> str | None:
    """A special token as transformers writes it: a string, or an AddedToken object with its text as "content"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise UsageError(f"{path}: {key} must be a string or an object with a \"content\" string, not {value!r}")


def _extra_special_tokens(data: dict, path: Path) -> list[str]:
    """additional_special_tokens (transformers 4) and extra_special_tokens (5: a list, or names to tokens)."""
    out: list[str] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = data.get(key) or []
        value = list(value.values()) if isinstance(value, dict) else value
        if not isinstance(value, list):
            raise UsageError(f"{path}: {key} must be a list of tokens, not {value!r}")
        for token in (_token_content(v, path, key) for v in value):
            if token is not None and token not in out:
                out.append(token)
    return out
