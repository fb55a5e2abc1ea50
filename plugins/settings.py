"""Typed provider settings: built from defaults, a YAML/TOML file and `--set key=value`, strictly checked."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from mimo.errors import UsageError

from . import constraints, settings_file
from .hints import suggest
from .types import Provider

SETTINGS_FILE_OPTION = "--provider-config"  # how messages name a settings file


def describe_fields(settings_cls: type, defaults: dict | None = None) -> list[dict]:
    """Name, type, default, help and declared rules of each setting, for `mimo providers show`."""
    hints = typing.get_type_hints(settings_cls)
    instance = settings_cls(**(defaults or {}))
    rules = constraints.declared(settings_cls)
    return [
        {
            "name": f.name,
            "type": _type_name(hints[f.name]),
            "default": getattr(instance, f.name),
            "help": f.metadata.get("help", ""),
            "rules": rules.get(f.name, {}),
        }
        for f in dataclasses.fields(settings_cls)
    ]


def build_settings(provider: Provider, assignments: list[str] = (), config_file: Path | None = None,
                   run_file_values: dict | None = None, run_file: Path | None = None, base: dict | None = None):
    """The provider's settings object: its defaults, then `base` (what the run's Hugging Face folders determine),
    then a run file's `settings:` section, then the settings file's values, then each `key=value`."""
    values: dict[str, Any] = {**provider.defaults, **(base or {})}
    for _, given in _given(provider, assignments, config_file, run_file_values, run_file):
        values.update(given)
    constraints.check(provider.settings, {**_field_defaults(provider.settings), **values}, provider.name)
    try:
        return provider.settings(**values)
    except (TypeError, ValueError) as err:
        raise UsageError(f"invalid settings for provider '{provider.name}': {err}") from None


def given_settings(provider: Provider, assignments: list[str] = (), config_file: Path | None = None,
                   run_file_values: dict | None = None, run_file: Path | None = None) -> dict[str, tuple[Any, str]]:
    """{setting: (value, where it was given)} of the settings given explicitly, the last source winning."""
    out = {}
    for source, given in _given(provider, assignments, config_file, run_file_values, run_file):
        out.update({key: (value, source) for key, value in given.items()})
    return out


def _given(provider, assignments, config_file, run_file_values, run_file) -> list[tuple[str, dict]]:
    """(source, checked values) of each explicit source, in the order they apply."""
    layers = []
    if run_file_values:
        layers.append((f"--config {run_file}", _check_all(provider, run_file_values, source=f"--config {run_file}")))
    if config_file is not None:
        layers.append((str(config_file), _check_all(provider, settings_file_values(provider, config_file),
                                                    source=str(config_file))))
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set expects key=value, got '{assignment}'")
        layers.append(("--set", _check_all(provider, {key.strip(): raw}, source="--set", from_text=True)))
    return layers


def _field_defaults(settings_cls: type) -> dict:
    return {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(settings_cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def read_settings_file(path: Path) -> dict:
    """A --provider-config file's mapping as written (one wording of its errors: plugins/settings_file.py)."""
    return settings_file.read(path, SETTINGS_FILE_OPTION, "setting names to values")


def settings_file_values(provider: Provider, path: Path) -> dict:
    """The settings a --provider-config file gives, unchecked. The file may name the provider it holds settings
    for (`provider: NAME`, as `mimo ckpt import-hf` writes it); then it must be the run's."""
    data = read_settings_file(path)
    if "provider" not in data or "provider" in typing.get_type_hints(provider.settings):
        return data
    named = data.pop("provider")
    if named != provider.name:
        raise UsageError(f"{SETTINGS_FILE_OPTION} {path} holds settings for provider '{named}', this run uses "
                         f"'{provider.name}': drop the file or choose --provider {named}")
    return data


def _check_all(provider: Provider, values: dict, source: str, from_text: bool = False) -> dict:
    hints = typing.get_type_hints(provider.settings)
    checked = {}
    for key, value in values.items():
        if key not in hints:
            raise UsageError(
                f"unknown setting '{key}' for provider '{provider.name}' ({source}){suggest(key, hints)}"
                f" (see: mimo providers show {provider.name})"
            )
        checked[key] = _coerce(key, value, hints[key], from_text, provider.name)
    return checked


def _coerce(key: str, value: Any, expected, from_text: bool, provider_name: str) -> Any:
    if from_text and not _accepts(expected, str):
        value = yaml.safe_load(value) if value.strip() else None
    if isinstance(value, str) and _accepts(expected, float):
        # YAML 1.1 reads 1e-3 (no dot) as text; a float setting means a number.
        try:
            value = float(value)
        except ValueError:
            pass
    if _matches(value, expected):
        # YAML reads 1e-3 as a float but "1" as an int: an int is a valid float setting.
        return float(value) if _accepts(expected, float) and type(value) is int else value
    raise UsageError(
        f"setting '{key}' of provider '{provider_name}' must be {_type_name(expected)}, got {value!r}"
    )


def _accepts(expected, kind: type) -> bool:
    return expected is kind or kind in typing.get_args(expected)


def _matches(value: Any, expected) -> bool:
    origin = typing.get_origin(expected)
    if expected is Any:
        return True
    if origin is Literal:
        return value in typing.get_args(expected)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, option) for option in typing.get_args(expected))
    if origin in (list, tuple):
        item_types = typing.get_args(expected)
        item = item_types[0] if item_types else Any
        return isinstance(value, (list, tuple)) and all(_matches(v, item) for v in value)
    if expected is type(None):
        return value is None
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _type_name(expected) -> str:
    origin = typing.get_origin(expected)
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(expected))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(option) for option in typing.get_args(expected))
    if expected is type(None):
        return "null"
    if origin in (list, tuple):  # `--set key=[a, b]` (YAML's flow list); the bare class name said nothing of that
        items = typing.get_args(expected)
        plural = {int: "integers", float: "numbers", bool: "true/false values", str: "strings"}.get(
            items[0] if items else None, "values")
        return f"a list of {plural}, written [a, b, ...]"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        expected, getattr(expected, "__name__", str(expected))
    )
