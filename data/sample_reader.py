"""A dataset's samples in their stored order, for `mimo data inspect` and `mimo data preview`.

Every dataset mimo reads opens here through energon's own loading (a prepared folder of any accepted sample type,
a crude chat dataset with the task encoder's cookers, a metadataset's blend), read one sample at a time in this
process, unshuffled. A blend's members are read side by side, each in its stored order, taking samples in
proportion to their blend weights (smooth weighted round robin): the first N samples mix the members as training's
blend does on average. A sample that cannot be read keeps its place as the `SkipRecord` the loader would count
(unreadable, unsupported: `deferred_errors.py` classifies it as in training).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from megatron.energon import DefaultTaskEncoder, stateless

from mimo.errors import UsageError

from .chat_cooker import CHAT_COOKER
from .check import check_dataset
from .deferred_errors import defer_dataset_errors, defer_load_errors
from .sample_formats import check_readable
from .skips import SkippedSampleCounter, SkipRecord
from .task_encoder import EncodedSample, is_tombstone

__all__ = ["Member", "Read", "SampleReader", "split_sizes"]

FALLBACK_SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class Member:
    """One dataset of what was opened (a blend has several)."""

    path: str
    sample_type: str  # the class its samples are declared as
    weight: float  # its share of the blend (1.0 alone)
    samples: int  # in the split read


@dataclass(frozen=True)
class Read:
    """One sample as read: the cooked energon sample, or why it cannot be trained on."""

    member: int  # index into SampleReader.members
    sample: Any = None
    skipped: SkipRecord | None = None


def _worker_config(counter: SkippedSampleCounter | None = None):
    from megatron.energon import WorkerConfig

    return WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=counter or SkippedSampleCounter())


def _loader(path: Path, command: str = "dataset"):
    from megatron.energon import load_dataset

    check_dataset(path, command)  # a JSON file, a folder without .nv-meta, a class not importable: one line
    try:
        return load_dataset(str(path))
    except UsageError:
        raise
    except Exception as err:  # noqa: BLE001 - energon's many ways of saying it is not a dataset
        raise UsageError(f"{path}: not an energon dataset or metadataset ({_first_line(err)})") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


def _split_names(loader, path: Path) -> list[str]:
    declared = getattr(loader, "splits", None)  # a metadataset's
    if isinstance(declared, dict) and declared:
        return list(declared)
    split_yaml = path / ".nv-meta" / "split.yaml"
    if path.is_dir() and split_yaml.is_file():
        import yaml

        parts = (yaml.safe_load(split_yaml.read_text()) or {}).get("split_parts")
        if isinstance(parts, dict) and parts:
            return [str(name) for name in parts]
    return list(FALLBACK_SPLITS)


def _members(loader, split: str, decoder=None):
    """energon's loaded datasets of `split` ([] when the split is declared but empty), their files decoded by
    `decoder` (the reading task encoder's)."""
    from megatron.energon.flavors.webdataset.empty_dataset_error import EmptyDatasetError

    kwargs = {"decoder": decoder} if decoder is not None else {}
    try:
        return loader.get_datasets(training=False, split_part=split, worker_config=_worker_config(), **kwargs).datasets
    except EmptyDatasetError:
        return []


def split_sizes(path) -> dict[str, int]:
    """{split: samples} for every split the dataset or metadataset at `path` declares (0 for an empty one)."""
    path = Path(path)
    loader = _loader(path)
    sizes = {}
    for name in _split_names(loader, path):
        try:
            sizes[name] = sum(len(m.dataset) for m in _members(loader, name))
        except (KeyError, AssertionError):  # a metadataset without it, a split.yaml naming it oddly
            continue
    return sizes


class _Cooked(DefaultTaskEncoder):
    """The task encoder energon reads with here: the cookers and decoder of the one training uses, and no encoding
    (each sample comes through cooked, one at a time)."""

    def __init__(self, cookers, decoder=None):
        super().__init__()
        self.cookers = list(cookers)
        if decoder is not None:
            self.decoder = decoder

    @stateless
    def encode_sample(self, sample):
        return sample

    def batch(self, samples):
        return samples


class SampleReader:
    """The samples of `path`'s `split`, in stored order (a blend's members side by side by weight).

    `encoder`: the task encoder training reads with (its cookers and decoder are used), or None for mimo's own;
    `reader`: who reads (for the line refusing a sample type), `command`: what was given the path (for the line
    refusing what is not a dataset). Raises UsageError (one line) for what is not a dataset, a split it does not
    have, a sample type mimo does not read."""

    def __init__(self, path, split: str = "train", encoder=None, reader: str = "mimo", command: str = "dataset"):
        self.path, self.split = Path(path), split
        if not self.path.exists():
            raise UsageError(f"{self.path}: no such file or directory")
        loader = _loader(self.path, command)
        names = _split_names(loader, self.path)
        cookers = getattr(encoder, "cookers", None) or [CHAT_COOKER]
        # a sample that fails comes as a tombstone, in its place
        self._reader = defer_load_errors(_Cooked(cookers, getattr(encoder, "decoder", None)))
        try:
            loaded = _members(loader, split, self._reader.decoder) if split in names else None
        except (KeyError, AssertionError):
            loaded = None
        if not loaded:
            sizes = split_sizes(self.path)
            have = ", ".join(f"{name} ({count} samples)" for name, count in sizes.items()) or "none"
            what = "has no samples in split" if loaded is not None else "has no split"
            raise UsageError(f"{self.path} {what} '{split}': its splits are {have}; choose one with --split")
        for member in loaded:
            check_readable(member.dataset.__sample_type__, getattr(member.dataset, "path", self.path), reader)
            defer_dataset_errors(member.dataset)  # a damaged shard's samples, a missing part: skipped, named
        weights = [m.weight if m.weight is not None else 1.0 for m in loaded]
        total = sum(weights) or 1.0
        self.members = [Member(str(getattr(m.dataset, "path", self.path)), m.dataset.__sample_type__.__name__,
                               w / total, len(m.dataset)) for m, w in zip(loaded, weights)]
        self._loaded = loaded

    def _stream(self, index: int) -> Iterator[Read]:
        from megatron.energon import get_loader

        counter = SkippedSampleCounter()
        config = _worker_config(counter)
        dataset = self._reader.build_val_datasets(datasets=[self._loaded[index]], worker_config=config,
                                                  batch_size=1)
        for batch in get_loader(dataset):
            for record in counter.take_records():  # what failed inside energon itself, counted there
                yield Read(index, skipped=record)
            for sample in batch:
                if isinstance(sample, EncodedSample) and is_tombstone(sample):
                    yield from (Read(index, skipped=record) for record in sample.dropped)
                else:
                    yield Read(index, sample=sample)
        for record in counter.take_records():
            yield Read(index, skipped=record)

    def __iter__(self) -> Iterator[Read]:
        """Every sample of the split once (a blend: the members interleaved by weight until each is read)."""
        streams = {i: self._stream(i) for i in range(len(self.members))}
        credit = {i: 0.0 for i in streams}
        while streams:
            for i in streams:
                credit[i] += self.members[i].weight
            pick = max(streams, key=lambda i: credit[i])
            credit[pick] -= sum(self.members[i].weight for i in streams)
            read = next(streams[pick], None)
            if read is None:
                del streams[pick], credit[pick]
                continue
            yield read
