"""`mimo run`'s loop options, generated from the loop's config dataclasses so help, defaults and types have one
source. Each component's options show under their own heading in `--help`."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import typing
from pathlib import Path
from typing import Annotated, Literal

import typer

from mimo.core import run_file
from mimo.core.config import COMPONENTS, RunConfig
from mimo.errors import UsageError


def loop_parameters() -> list[inspect.Parameter]:
    params = []
    for component in COMPONENTS:
        heading, cls = component.heading, component.options
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind, default = hints[f.name], f.default
            if typing.get_origin(kind) is Literal:  # a str Enum: choices every typer version shows and checks
                kind = enum.Enum(f.name, {str(v): str(v) for v in typing.get_args(kind)}, type=str)
                default = kind(default)
            option = typer.Option(help=f.metadata.get("help"), rich_help_panel=heading, show_default=True)
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                            annotation=Annotated[kind, option]))
    return params


def provider_parameters() -> list[inspect.Parameter]:
    def param(name, kind, default, **option):
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                 annotation=Annotated[kind, typer.Option(rich_help_panel="Provider", **option)])

    return [
        param("provider", typing.Optional[str], None,
              help="the model family to train (see: mimo providers list); required unless --config or "
                   "--provider-config names it"),
        param("set", typing.Optional[list[str]], None, help="a provider setting, key=value; repeatable"),
        param("provider_config", typing.Optional[Path], None,
              help="a YAML or TOML file of provider settings (--set wins over it); it may name its provider "
                   "(provider: NAME)"),
        param("config", typing.Optional[Path], None,
              help="a YAML or TOML file holding a whole run: provider, settings and loop options in sections "
                   "(docs/configuration.md); options on the command line win over it"),
    ]


def with_options(function, params: list[inspect.Parameter]):
    """Give `function(**kwargs)` the signature typer reads its options from."""
    function.__signature__ = inspect.Signature(params)
    return function


# A run file's model parts, which a --pretrained typed on the command line replaces (stage 2 from stage 1's
# run.yaml must not load the parts again).
PART_OPTIONS = ("pretrained_llm", "pretrained_vision")
CONTEXT = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)


def given_on_command_line(ctx) -> set[str]:
    """The parameters the user typed (not defaults), from typer's context of the running command."""
    if ctx is None:
        return set()
    return {name for name in ctx.params
            if (source := ctx.get_parameter_source(name)) is not None
            and source.name not in ("DEFAULT", "DEFAULT_MAP")}


def _provider_named_by(provider_config: Path | None) -> str | None:
    """The provider a --provider-config file names (`provider: NAME`, as `mimo ckpt import-hf` writes it)."""
    if provider_config is None:
        return None
    from mimo.plugins.settings import read_settings_file  # here: the CLI loads without torch (test_architecture)

    named = read_settings_file(provider_config).get("provider")
    return named if isinstance(named, str) else None


def refuse_packing_without_data(config: RunConfig, ctx) -> None:
    """--pack-sequences (or --packing-buffer-size, --pack-image-tokens) typed where there is no --data: the provider's synthetic batches
    are never packed, so the option would change nothing; one line instead of silence."""
    if config.data.data is not None or ctx is None:
        return
    typed = given_on_command_line(ctx)
    for name, flag in (("pack_sequences", "--pack-sequences"), ("packing_buffer_size", "--packing-buffer-size"),
                       ("pack_image_tokens", "--pack-image-tokens")):
        if name in typed and ctx.params.get(name) not in (False, None):
            raise UsageError(f"{flag} packs --data's samples; without --data the provider's synthetic batches are "
                             f"not packed: give --data DIR, or leave {flag} out")


def run_config(kwargs: dict, ctx=None, from_checkpoint: bool = False) -> RunConfig:
    """The RunConfig of the command line (`ctx`: typer's context, which says what was typed), over --config's
    file where one is given. `from_checkpoint`: the caller adds what a checkpoint says (--data among it) and
    checks the data options itself."""
    values = {k: v.value if isinstance(v, enum.Enum) else v for k, v in kwargs.items()}
    file_values = run_file.read(values["config"]) if values.get("config") else None
    typed = given_on_command_line(ctx) if file_values else set()
    parts = {}
    for section, cls in run_file.sections().items():
        chosen = {}
        for f in dataclasses.fields(cls):
            replaced = f.name in PART_OPTIONS and "pretrained" in typed  # --pretrained on the command line wins
            if file_values and f.name not in typed and f.name in file_values.get(section, {}) and not replaced:
                chosen[f.name] = run_file.option_value(section, f.name, file_values[section][f.name],
                                                       values["config"])
            else:
                chosen[f.name] = values[f.name]
        parts[section] = cls(**chosen)
    provider = (values.get("provider") or (file_values or {}).get(run_file.PROVIDER)
                or _provider_named_by(values.get("provider_config")))
    if not provider:
        raise UsageError("--provider NAME is needed (or 'provider: NAME' in the --config or --provider-config "
                         "file); see: mimo providers list")
    named = (file_values or {}).get(run_file.PROVIDER)
    if named not in (None, provider):
        raise UsageError(f"--config {values['config']} is a run of provider '{named}', --provider says '{provider}': "
                         f"its settings are '{named}''s; drop one of the two")
    file_settings = (file_values or {}).get(run_file.SETTINGS, {})
    config = RunConfig(provider=provider, provider_settings=list(values.get("set") or []),
                       provider_config=values.get("provider_config"), provider_values=dict(file_settings),
                       config_file=values.get("config"), **parts)
    if not from_checkpoint:
        refuse_packing_without_data(config, ctx)
    return config
