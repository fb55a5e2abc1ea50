"""Before any process or model: can the dataset's declared classes be imported here?

A dataset's `.nv-meta/dataset.yaml` names the Python class its samples are (`__module__`/`__class__`, or
`sample_type:` with them); energon imports it when the dataset is opened. A class from a package this environment
lacks (e.g. Megatron-Bridge's `ChatMLWebdataset`) would fail there, deep in the loader, after the model was built.
`check_dataset` walks `--data` (a dataset directory, or a metadataset YAML and every `path:` it names, recursively)
and says in one line which file names which class, why it cannot be imported, and what mimo reads instead. A JSON
file given as `--data` (LLaVA records, not yet a dataset) is one line naming the converter.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import yaml

from mimo.errors import UsageError

from .foreign_samples import foreign_note
from .sample_formats import readable_type_names

__all__ = ["check_dataset", "foreign_notes", "unreadable_dataset"]

_MAX_DEPTH = 8  # metadatasets naming metadatasets


def check_dataset(path, flag: str = "--data") -> None:
    """UsageError (one line) when a dataset under `path` names a class that cannot be imported."""
    problem = unreadable_dataset(path, flag)
    if problem:
        raise UsageError(problem)


def unreadable_dataset(path, flag: str = "--data") -> str | None:
    """The one-line problem of the first dataset under `path` whose declared class cannot be imported, or None."""
    path = Path(path)
    if not path.exists():
        return None  # the loader says so in its own words
    if _raw_json(path):
        return (f"{flag} {path}: a JSON file, not an energon dataset; LLaVA-style records (conversations or messages, "
                f"with their images) become one with `mimo data convert llava {path} IMAGE_DIR OUT`, then "
                f"{flag} OUT")
    if path.is_dir() and not (path / ".nv-meta").is_dir():
        return (f"{flag} {path}: a folder without .nv-meta, not an energon dataset: prepare its shards with "
                f"`energon prepare {path}` (docs/data.md), or make a sample one with `mimo data sample DIR`")
    try:
        for dataset_yaml in _dataset_yamls(path, 0):
            problem = _check_yaml(dataset_yaml)
            if problem:
                where = dataset_yaml.relative_to(path) if dataset_yaml.is_relative_to(path) else dataset_yaml
                return f"{flag} {path}: {where} {problem}"
    except _UnreadableYaml as err:
        return f"{flag} {path}: {err}: fix it (a dataset's .nv-meta files: prepare it again with `energon prepare`)"
    except (OSError, yaml.YAMLError) as err:
        return f"{flag} {path}: not an energon dataset or metadataset ({type(err).__name__}: {err})"
    return None


class _UnreadableYaml(yaml.YAMLError):
    """A dataset.yaml or metadataset that is not YAML, in one line (the parser's message spans several)."""


def _read_yaml(file: Path):
    try:
        return yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        why = getattr(err, "problem", None) or type(err).__name__
        raise _UnreadableYaml(f"{file} is not readable YAML ({why}{where})") from None


def foreign_notes(path, flag: str = "--data") -> list[str]:
    """A line for each dataset under `path` whose declared class is another framework's that mimo reads as its own
    format (foreign_samples.py), for the console before the run."""
    path = Path(path)
    notes = []
    try:
        for dataset_yaml in _dataset_yamls(path, 0) if path.exists() else ():
            config = _read_yaml(dataset_yaml) or {}
            declared = config.get("sample_type", config) if isinstance(config, dict) else None
            if isinstance(declared, dict) and (note := foreign_note(str(declared.get("__module__")),
                                                                     str(declared.get("__class__")))):
                where = dataset_yaml.relative_to(path) if dataset_yaml.is_relative_to(path) else dataset_yaml
                notes.append(f"{flag} {path}: {where} {note}")
    except (OSError, yaml.YAMLError):
        return []  # check_dataset names the problem
    return notes


def _raw_json(path: Path) -> bool:
    """A JSON or JSON-lines file energon cannot read as it is (a prepared JSON-lines dataset has its index)."""
    if not path.is_file():
        return False
    suffix = path.suffix.lower()
    return suffix == ".json" or (suffix == ".jsonl" and not path.with_name(path.name + ".idx").exists())


def _dataset_yamls(path: Path, depth: int):
    if path.is_dir():
        candidate = path / ".nv-meta" / "dataset.yaml"
        if candidate.is_file():
            yield candidate
        return
    if depth > _MAX_DEPTH or path.suffix not in (".yaml", ".yml"):
        return
    for sub in _paths_in(_read_yaml(path)):
        yield from _dataset_yamls((path.parent / sub).resolve(), depth + 1)


def _paths_in(node):
    """Every `path:` value of a metadataset's mappings."""
    if isinstance(node, dict):
        if isinstance(node.get("path"), str):
            yield node["path"]
        for value in node.values():
            yield from _paths_in(value)
    elif isinstance(node, list):
        for value in node:
            yield from _paths_in(value)


def _check_yaml(dataset_yaml: Path) -> str | None:
    config = _read_yaml(dataset_yaml) or {}
    if not isinstance(config, dict):
        return None
    declared = config if "__module__" in config else config.get("sample_type")
    if isinstance(declared, dict) and "__module__" in declared and "__class__" in declared:
        name = f"{declared['__module__']}.{declared['__class__']}"
        try:
            getattr(importlib.import_module(declared["__module__"]), declared["__class__"])
        except Exception as err:  # noqa: BLE001 - whatever the import raises, the user gets the one line
            if foreign_note(declared["__module__"], declared["__class__"]):
                return None  # read as mimo's own format (foreign_samples.py)
            why = str(err).splitlines()[0] if str(err) else type(err).__name__
            return (f"names the sample class {name}, which cannot be imported here ({why}); mimo reads "
                    f"{', '.join(readable_type_names())}: prepare the shards again with `energon prepare DIR "
                    f"--sample-type CrudeWebdataset` (chat) or another type mimo reads, or convert the source data "
                    f"(mimo data convert llava)")
    loader = config.get("sample_loader")
    if isinstance(loader, str) and ":" in loader:
        file = dataset_yaml.parent / loader.split(":", 1)[0]
        try:
            spec = importlib.util.spec_from_file_location(f"_mimo_check_{file.stem}", file)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        except Exception as err:  # noqa: BLE001
            why = str(err).splitlines()[0] if str(err) else ""
            return f"names the sample loader {loader}, which cannot be loaded here ({type(err).__name__}: {why})"
    return None
