"""Registration and settings: the provider is what `register_providers` returns, and its settings dataclass
survives `--set key=value` strings and YAML/TOML config files, the two ways users set it."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from pathlib import Path

import yaml

from mimo.errors import UsageError
from mimo.plugins import Provider
from mimo.plugins.settings import build_settings

from .report import ContractError
from .subject import Subject, check_defaults_exist


def check_registration(subject: Subject) -> None:
    """`register_providers` returns mimo.Provider objects, this one among them, with a settings dataclass whose
    every field has a default and whose `defaults` name only its fields."""
    results = [p for result in subject.call("register_providers") for p in _as_list(result)]
    if not any(p is subject.provider or p == subject.provider for p in results):
        raise ContractError("register_providers", f"the plugin's result does not hold provider '{subject.name}'")
    provider = subject.provider
    if not isinstance(provider, Provider):
        raise ContractError("register_providers", f"returned {type(provider).__name__}, not mimo.Provider")
    if not (isinstance(provider.settings, type) and dataclasses.is_dataclass(provider.settings)):
        raise ContractError("register_providers", f"'{provider.name}': settings must be a dataclass class, got "
                                                  f"{provider.settings!r}")
    fields = {f.name for f in dataclasses.fields(provider.settings)}
    unknown = sorted(set(provider.defaults) - fields)
    if unknown:
        raise ContractError("register_providers", f"'{provider.name}': defaults name {unknown}, which are not "
                                                  f"fields of {provider.settings.__name__}")
    check_defaults_exist(provider)
    try:
        provider.settings(**provider.defaults)
    except (TypeError, ValueError) as err:
        raise ContractError("settings", f"the defaults of '{provider.name}' are invalid: {err}") from None


def check_settings_round_trip(subject: Subject, directory: Path) -> None:
    """The subject's settings, written as `--set` strings, as YAML and as TOML, read back equal."""
    provider, settings = subject.provider, subject.settings
    values = dataclasses.asdict(settings)
    hints = typing.get_type_hints(provider.settings)
    for key, value in values.items():
        if not _is_plain(value):
            raise ContractError("settings", f"'{key}' = {value!r} is a {type(value).__name__}; settings must be int, "
                                            f"float, bool, str, a Literal, None or lists of them (what --set and "
                                            f"config files can express)")
    expected = _plain(values)
    assignments = [f"{k}={_as_text(v, hints[k])}" for k, v in values.items() if _expressible(v, hints[k])]
    _compare(provider, expected, "--set key=value strings", assignments=assignments)
    yaml_file = Path(directory) / "settings.yaml"
    yaml_file.write_text(yaml.safe_dump(values, sort_keys=False))
    _compare(provider, expected, "a YAML file", config_file=yaml_file)
    toml_file = Path(directory) / "settings.toml"
    toml_file.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in values.items() if v is not None))
    _compare(provider, expected, "a TOML file", config_file=toml_file)


def _compare(provider: Provider, expected: dict, how: str, **source) -> None:
    try:
        got = _plain(dataclasses.asdict(build_settings(provider, **source)))
    except UsageError as err:
        raise ContractError("settings", f"{how} does not read back: {err}") from None
    changed = [k for k in expected if got.get(k) != expected[k]]
    if changed:
        k = changed[0]
        raise ContractError("settings", f"'{k}' = {expected[k]!r} reads back from {how} as {got.get(k)!r}")


def _expressible(value, expected) -> bool:
    """None cannot be written for a setting that also takes text: `--set x=` means the empty string."""
    return not (value is None and (expected is str or str in typing.get_args(expected)))


def _as_text(value, expected) -> str:
    """How a user writes `value` after `--set key=`: text as is for text settings, YAML for the rest."""
    if isinstance(value, str) and (expected is str or str in typing.get_args(expected)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        # `yaml.safe_dump` writes 1e-05 as 1.0e-05, which YAML reads back as a number (1e-05 it reads as text).
        return yaml.safe_dump(value).splitlines()[0]
    return yaml.safe_dump(_plain(value), default_flow_style=True).splitlines()[0]


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string uses JSON's escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise ContractError("settings", f"{value!r} cannot be written to a TOML file (None inside a list?)")


def _plain(value):
    """Tuples read back as lists: compare them as lists."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _is_plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _as_list(result) -> list:
    return list(result) if isinstance(result, (list, tuple)) else [result]
