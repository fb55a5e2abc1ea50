"""A whole run in one file (`mimo run --config run.yaml`, YAML or TOML): the provider, its settings and the loop
options, in sections named after RunConfig's components.

    provider: nemotron-moe-vlm-tiny
    settings:            # the provider's own settings (as --set / --provider-config)
      seq_length: 256
    training:            # the loop options of each component, as `mimo run --help` groups them
      train_iters: 200
      micro_batch_size: 4
    optimizer:
      lr: 1.0e-4

Options given on the command line win over the file. `--print-config` writes a run's effective configuration in
this form (every option and every setting), and each checkpoint keeps it as `run.yaml`, so
`mimo run --config CKPT/iter_0000100/run.yaml` repeats the run.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from pathlib import Path

import yaml

from mimo.errors import UsageError

from .config import COMPONENTS, RunConfig

PROVIDER, SETTINGS = "provider", "settings"
FILE_NAME = "run.yaml"  # what each checkpoint keeps


def sections() -> dict[str, type]:
    """{section name: options dataclass}: the loop's components, in their order."""
    return {component.name: component.options for component in COMPONENTS}


def read(path: Path) -> dict:
    """The file's values as {"provider": str|None, "settings": dict, section: {option: value}}, every name
    checked (unknown names are one line with the closest valid one)."""
    # The public API's package imports torch: the CLI reads its options before torch loads (cli/console.py)
    from mimo.plugins import settings_file
    from mimo.plugins.hints import suggest

    path = Path(path)
    data = settings_file.read(path, "--config", "sections (provider, settings and the option sections) to values")
    known = sections()
    owner = {f.name: name for name, cls in known.items() for f in dataclasses.fields(cls)}
    result = {PROVIDER: data.get(PROVIDER), SETTINGS: data.get(SETTINGS) or {}}
    if result[PROVIDER] is not None and not isinstance(result[PROVIDER], str):
        raise UsageError(f"--config {path}: 'provider' must be a provider's name")
    if not isinstance(result[SETTINGS], dict):
        raise UsageError(f"--config {path}: 'settings' must map provider setting names to values")
    for key, values in data.items():
        if key in (PROVIDER, SETTINGS):
            continue
        if key not in known:
            where = (f"; '{key}' is an option of section '{owner[key]}'" if key in owner
                     else suggest(key, [PROVIDER, SETTINGS, *known]))
            raise UsageError(f"--config {path}: unknown section '{key}'{where}")
        if not isinstance(values, dict):
            raise UsageError(f"--config {path}: section '{key}' must map option names to values")
        names = {f.name for f in dataclasses.fields(known[key])}
        for option in values:
            if option not in names:
                where = (f"; '{option}' belongs in section '{owner[option]}'" if option in owner
                         else suggest(option, names))
                raise UsageError(f"--config {path}: unknown option '{option}' in section '{key}'{where}")
        result[key] = values
    return result


def option_value(section: str, name: str, value, path: Path):
    """A file's value in the type the option has (paths as Path, numbers checked), or one line naming it."""
    field_type = typing.get_type_hints(sections()[section])[name]
    optional = typing.get_origin(field_type) in (typing.Union, types.UnionType)
    if optional and value is None:
        return None
    kind = next(k for k in typing.get_args(field_type) if k is not type(None)) if optional else field_type
    if typing.get_origin(kind) is typing.Literal:
        if value in typing.get_args(kind):
            return value
        allowed = ", ".join(map(str, typing.get_args(kind)))
        raise UsageError(f"--config {path}: {section}.{name} must be one of {allowed}, got {value!r}")
    if kind is Path and isinstance(value, str):
        return Path(value)
    if kind is float and isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as text
        try:
            return float(value)
        except ValueError:
            pass
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool)):
        return value
    raise UsageError(f"--config {path}: {section}.{name} must be {_KIND_NAMES.get(kind, kind.__name__)}, got "
                     f"{value!r}")


_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", Path: "a path"}


def _plain(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def effective(config: RunConfig, settings) -> dict:
    """The run as a --config file holds it: the provider, every setting as built, every loop option."""
    values = {PROVIDER: config.provider, SETTINGS: _plain(dataclasses.asdict(settings))}
    for name in sections():
        values[name] = _plain(dataclasses.asdict(getattr(config, name)))
    return values


def dump(config: RunConfig, settings) -> str:
    return yaml.safe_dump(effective(config, settings), sort_keys=False)


def refuse_loop_settings(config: RunConfig, settings_cls: type) -> None:
    """A loop option given as a provider setting (`--set lora_rank=4`, or in a --config file's `settings`
    section) gets one line naming the option, not "unknown setting" with a setting's name guessed."""
    settings = {f.name for f in dataclasses.fields(settings_cls)}
    fields = {f.name: (name, f) for name, cls in sections().items() for f in dataclasses.fields(cls)}
    for assignment in config.provider_settings:
        key, sep, value = (part.strip() for part in assignment.partition("="))
        if sep and key in fields and key not in settings:
            flag = f"--{key.replace('_', '-')}"
            if isinstance(fields[key][1].default, bool):
                typed = flag if yaml.safe_load(value or "true") else f"--no-{flag[2:]}"
            else:
                typed = f"{flag} {value}" if value else flag
            raise UsageError(f"--set {assignment}: '{key}' is a loop option, not a provider setting: pass {typed}")
    if config.config_file is not None:
        for key in config.provider_values:
            if key in fields and key not in settings:
                raise UsageError(f"--config {config.config_file}: '{key}' is a loop option, not a provider "
                                 f"setting: move it from section '{SETTINGS}' to section '{fields[key][0]}'")


def refuse_loop_options(path: Path, settings_cls: type) -> None:
    """A --provider-config file holds provider settings only: a loop option there gets one line saying where it
    goes (a closest-setting guess would mislead)."""
    from mimo.plugins.settings import SETTINGS_FILE_OPTION, read_settings_file  # torch: see read()

    data = read_settings_file(path)
    settings = {f.name for f in dataclasses.fields(settings_cls)}
    owner = {f.name: name for name, cls in sections().items() for f in dataclasses.fields(cls)}
    for key in data:
        if key in owner and key not in settings:
            raise UsageError(f"{SETTINGS_FILE_OPTION} {path}: '{key}' is a loop option, not a provider setting: "
                             f"pass --{key.replace('_', '-')}, or write the whole run in a --config file (its "
                             f"'{owner[key]}' section)")
        if key in sections() and key not in settings:
            raise UsageError(f"{SETTINGS_FILE_OPTION} {path} has a '{key}' section: a file of provider and loop "
                             f"options is a run file, pass it with --config")
