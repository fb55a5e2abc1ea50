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

from mimo.core.config import COMPONENTS, RunConfig


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
        param("provider", str, ..., help="the model family to train (see: mimo providers list)"),
        param("set", typing.Optional[list[str]], None, help="a provider setting, key=value; repeatable"),
        param("provider_config", typing.Optional[Path], None,
              help="a YAML or TOML file of provider settings (--set wins over it)"),
    ]


def with_options(function, params: list[inspect.Parameter]):
    """Give `function(**kwargs)` the signature typer reads its options from."""
    function.__signature__ = inspect.Signature(params)
    return function


def run_config(kwargs: dict) -> RunConfig:
    values = {k: v.value if isinstance(v, enum.Enum) else v for k, v in kwargs.items()}
    parts = {c.name: c.options(**{f.name: values[f.name] for f in dataclasses.fields(c.options)})
             for c in COMPONENTS}
    return RunConfig(provider=kwargs["provider"], provider_settings=list(kwargs.get("set") or []),
                     provider_config=kwargs.get("provider_config"), **parts)
