"""`mimo data convert llava JSON IMAGE_DIR OUT`: LLaVA-style records into an energon dataset mimo's chat cooker reads.

A record is `{"id": ..., "image": "a.jpg" | ["a.jpg", "b.png"], "conversations": [{"from": "human", "value":
"<image>\\nWhat is it?"}, {"from": "gpt", "value": "A cat."}]}` (or `messages` with role/content, and `system`).
Each record is checked with the functions the cooker uses at training time (`turns_from_chat_json`,
`place_images`), so `<image>` placeholders stay where they stand in the text and a record the run could not read
is named and counted here instead; each image is decoded in full (a truncated file fails now) and its bytes are
copied unchanged. The JSON is read one record at a time (json_stream.py).

Written: webdataset shards `train-NNNNNN.tar` / `val-NNNNNN.tar` / `test-NNNNNN.tar` (key = the record's index; parts `json` and `jpg`,
or `0.jpg`, `1.png`, ... for several images, named in the json's `images`), prepared with energon's own tooling as
a `CrudeWebdataset` (the cooker `ConversationTaskEncoder` registers reads it). The split is a hash of the record's
id: the same record goes to the same split however the file is ordered (val below `--val-fraction` of the hash's
range, test in the next `--test-fraction` of it). OUT is written as a partial folder beside
it and renamed at the end.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from mimo.errors import UsageError
from mimo.wording import counted

from ..conversation import place_images, turns_from_chat_json
from ..skips import describe_error
from .json_stream import JSONSyntaxError, records

__all__ = ["ConvertResult", "convert_llava"]

FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tif"}
SHOWN = 20  # bad records named one line each; the rest are counted
DATASET_YAML = "__module__: megatron.energon\n__class__: CrudeWebdataset\n"  # as `energon prepare` writes it


@dataclass
class ConvertResult:
    out: Path
    train: int = 0
    val: int = 0
    test: int = 0
    bad: list = field(default_factory=list)  # indices of the records skipped

    @property
    def read(self) -> int:
        return self.train + self.val + self.test + len(self.bad)

    def summary(self) -> str:
        first = f" (records {', '.join(map(str, self.bad[:10]))}{', ...' if len(self.bad) > 10 else ''})"
        return (f"converted {self.train + self.val + self.test} of {counted(self.read, 'record')} into {self.out}: "
                f"{self.train} train, {self.val} val, " + (f"{self.test} test, " if self.test else "")
                + f"{len(self.bad)} skipped" + (first if self.bad else ""))


def _image_names(record: dict) -> list[str]:
    image = record.get("image", record.get("images"))
    names = [] if image is None else [image] if isinstance(image, str) else image
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"'image' must be a file name or a list of them, got {image!r}")
    return names


def sample_of(record, image_dir: Path) -> tuple[dict, dict[str, bytes]]:
    """(the json part, {part name: bytes}) of a record, or ValueError saying why mimo could not train on it."""
    from PIL import Image

    if not isinstance(record, dict):
        raise ValueError(f"a record must be an object, got {type(record).__name__}")
    if "conversations" not in record and "messages" not in record:  # the chat's own check sees only these keys
        raise ValueError(f"the record has neither 'conversations' (from/value) nor 'messages' (role/content); its "
                         f"keys: {sorted(record)}")
    names = _image_names(record)
    chat = {k: record[k] for k in ("conversations", "messages", "system") if k in record}
    place_images(turns_from_chat_json(chat), len(names))  # the cooker's own checks, text unchanged
    parts = {}
    for k, name in enumerate(names):
        path = Path(name) if Path(name).is_absolute() else image_dir / name
        try:
            data = path.read_bytes()
        except OSError as err:
            raise ValueError(f"image {name}: {err.strerror or err}") from None
        try:
            with Image.open(io.BytesIO(data)) as image:
                kind = image.format
                image.load()  # decoded in full: a truncated file fails here, not in training
        except Exception as err:  # noqa: BLE001 - any undecodable file is the same problem
            raise ValueError(f"image {name} cannot be decoded ({describe_error(err)})") from None
        ext = FORMATS.get(kind)
        if ext is None:
            raise ValueError(f"image {name} is {kind}, which energon does not decode")
        parts[ext if len(names) == 1 else f"{k}.{ext}"] = data
    if len(names) > 1:
        chat["images"] = list(parts)
    if "id" in record:
        chat["id"] = record["id"]
    return chat, parts


def convert_llava(json_path, image_dir, out, val_fraction: float = 0.0, shard_size: int = 1000,
                  say=print, test_fraction: float = 0.0) -> ConvertResult:
    """Convert; `say` gets a line per bad record (the first SHOWN). UsageError when nothing could be converted."""
    json_path, image_dir, out = Path(json_path), Path(image_dir), Path(out)
    if not json_path.is_file():
        raise UsageError(f"{json_path}: no such file")
    if not image_dir.is_dir():
        raise UsageError(f"{image_dir}: no such directory")
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise UsageError(f"--val-fraction {val_fraction:g} and --test-fraction {test_fraction:g} must each lie in "
                         f"[0, 1) and leave records for training (their sum below 1)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} is not empty: convert into a new folder")
    partial = out.parent / f".{out.name}.mimo-partial-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    partial.mkdir()
    result = ConvertResult(out)
    try:
        _write(json_path, image_dir, partial, (val_fraction, test_fraction), shard_size, result, say)
        if not result.train:
            raise UsageError(f"{json_path}: none of its {counted(result.read, 'record')} could be converted for "
                             f"training (the lines above say why)")
        _prepare(partial)
        if out.is_dir():
            out.rmdir()
        os.replace(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return result


def _write(json_path, image_dir, folder, fractions, shard_size, result, say) -> None:
    import webdataset as wds

    val_fraction, test_fraction = fractions
    writers = {split: wds.ShardWriter(str(folder / f"{split}-%06d.tar"), maxcount=shard_size, maxsize=1 << 30,
                                      verbose=0) for split in ("train", "val", "test")}
    try:
        for index, offset, record in records(json_path):
            try:
                chat, parts = sample_of(record, image_dir)
            except ValueError as err:
                result.bad.append(index)
                if len(result.bad) <= SHOWN:
                    ident = record.get("id") if isinstance(record, dict) else None
                    say(f"skipped record {index} (id {ident!r}, character {offset}): {err}")
                continue
            share = zlib.crc32(str(chat.get("id", index)).encode()) / 2**32
            split = "val" if share < val_fraction else "test" if share < val_fraction + test_fraction else "train"
            writers[split].write({"__key__": f"{index:09d}", "json": json.dumps(chat, ensure_ascii=False).encode(),
                                  **parts})
            setattr(result, split, getattr(result, split) + 1)
    except JSONSyntaxError as err:
        raise UsageError(f"{json_path}: {err}") from None
    finally:
        for writer in writers.values():
            writer.close()
    for split in writers:  # a split with no sample (no --val-fraction) leaves an empty shard, which energon refuses
        if not getattr(result, split):
            for shard in folder.glob(f"{split}-*.tar"):
                shard.unlink()
    if len(result.bad) > SHOWN:
        say(f"skipped {counted(len(result.bad) - SHOWN, 'more record')} (not shown)")


def _prepare(folder: Path) -> None:
    """energon's own preparation (its index of the shards and the split), as a crude dataset."""
    from megatron.energon.flavors.webdataset import BaseWebdatasetFactory
    from megatron.energon.flavors.webdataset.config import MAIN_FOLDER_NAME

    shards = sorted(p.name for p in folder.glob("*.tar") if p.stat().st_size)
    for empty in folder.glob("*.tar"):
        if empty.name not in shards:
            empty.unlink()
    BaseWebdatasetFactory.prepare_dataset(folder, shards, split_parts_patterns=[
        ("train", r"^train-"), ("val", r"^val-"), ("test", r"^test-")], shuffle_seed=None, workers=1)
    (folder / MAIN_FOLDER_NAME / "dataset.yaml").write_text(DATASET_YAML)
