"""`data_provider` with `--data`: a provider reads the dataset `ctx.data_path` names, or refuses it with one
`mimo.errors.UsageError` line; it never trains on other data in its place.

Two probes: a folder that is not a dataset (it must be refused), and a small captioning dataset of real images
(`mimo data sample`'s) whose micro-batches must follow the schema and differ from the provider's data without
`--data`. A provider that reads no datasets at all passes by refusing both; the report notes it.
"""

from __future__ import annotations

import atexit
import itertools
import shutil
import tempfile
from pathlib import Path

import torch

from mimo.errors import UsageError
from mimo.plugins import DataContext, Encoder

from .data_check import SEED, check_micro_batch
from .data_source_check import check_capabilities, check_data_source
from .report import ContractError
from .subject import Subject

_probes: dict[str, Path] = {}  # written once per process


def _probe_dir() -> Path:
    if "root" not in _probes:
        root = Path(tempfile.mkdtemp(prefix="mimo-contract-data-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        from mimo.data import write_sample_dataset

        write_sample_dataset(root / "captions", num_samples=16, seed=SEED, shard_size=16)
        (root / "not_a_dataset").mkdir()
        (root / "not_a_dataset" / "notes.txt").write_text("no shards, no .nv-meta\n")
        _probes["root"] = root
    return _probes["root"]


def _read(subject: Subject, data_path: str | None, count: int) -> list[dict]:
    """`count` micro-batches of the hook for a one-lane DataContext; UsageError passes through."""
    ctx = DataContext(micro_batch_size=2, num_microbatches=1, num_lanes=1, seed=SEED, data_path=data_path)
    source = check_data_source(subject.hook("data_provider")(settings=subject.settings, ctx=ctx), subject.name)
    try:
        batches = list(itertools.islice(source, count))
        check_capabilities(source)
        return batches
    finally:
        source.close()


def _refusal(subject: Subject, path: Path, what: str) -> str | None:
    """The UsageError line the provider refuses `path` with, or None when it returned micro-batches."""
    try:
        _read(subject, str(path), 1)
    except UsageError as err:
        message = str(err)
        if "\n" in message.strip():
            raise ContractError("data_provider", f"given {what} it refused in several lines; a UsageError is one "
                                                 f"line: {message.splitlines()[0]!r}...") from None
        return message
    except ContractError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever the provider raised, the hook is what broke
        raise ContractError("data_provider", f"given {what} (ctx.data_path) it raised {type(err).__name__}: {err}; "
                                             f"refuse data it cannot read with mimo.errors.UsageError (one line)"
                            ) from err
    return None


def check_data_path(subject: Subject, encoders: dict[str, Encoder],
                    vocab_size: int | None = None) -> str | None:
    """Both probes (see the module docstring). Returns a note when the provider refuses every dataset."""
    root = _probe_dir()
    if _refusal(subject, root / "not_a_dataset", "a folder that is not an energon dataset") is None:
        raise ContractError("data_provider", "given ctx.data_path = a folder that is not an energon dataset it "
                                             "returned micro-batches: read the dataset ctx.data_path names "
                                             "(ctx.energon_loader) or raise mimo.errors.UsageError, never fall "
                                             "back to other data")
    refused = _refusal(subject, root / "captions", "a captioning dataset")
    if refused is not None:
        return f"refuses --data (a captioning dataset): {refused}"
    batches = _read(subject, str(root / "captions"), 2)
    for m, batch in enumerate(batches):
        check_micro_batch(batch, 2, encoders, vocab_size, f"micro-batch {m} of --data")
    synthetic = _read(subject, None, 2)
    if all(a["input_ids"].shape == b["input_ids"].shape and torch.equal(a["input_ids"], b["input_ids"])
           for a, b in zip(batches, synthetic)):
        raise ContractError("data_provider", "with ctx.data_path set it returned the same micro-batches as without "
                                             "it: it ignores --data (read the dataset, or refuse it with "
                                             "mimo.errors.UsageError)")
    return None
