"""`mimo providers new NAME [DIR]`: write a pip-installable provider package that passes mimo's contract tests.

The package is rendered from the files under `templates/provider/` (shipped as package data): `{{key}}` marks
are replaced by the names derived from NAME, and `package/` becomes the provider's module.
"""

from __future__ import annotations

import importlib.util
import keyword
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from mimo.errors import UsageError
from mimo.wording import counted

TEMPLATES = Path(__file__).parent / "templates" / "provider"
NAME_RULE = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")


@dataclass(frozen=True)
class Names:
    """Everything the templates name, derived from the provider name (e.g. my-vlm)."""

    provider: str  # the provider and entry-point name: my-vlm
    distribution: str  # the pip distribution: my-vlm
    module: str  # the Python package: my_vlm
    class_name: str  # MyVlm
    settings_class: str  # MyVlmSettings
    mimo_version: str

    @classmethod
    def of(cls, name: str) -> Names:
        from mimo import __version__

        camel = "".join(part.capitalize() for part in name.split("-"))
        return cls(name, name, name.replace("-", "_"), camel, f"{camel}Settings", __version__)


def check_name(name: str) -> Names:
    """The names for provider `name`, or a UsageError saying what is wrong with it."""
    if len(name) > 40 or not NAME_RULE.fullmatch(name):
        raise UsageError(f"invalid provider name '{name}': use lowercase letters, digits and single hyphens, "
                         f"starting with a letter, at most 40 characters (e.g. my-vlm)")
    names = Names.of(name)
    if keyword.iskeyword(names.module) or names.module in sys.stdlib_module_names:
        raise UsageError(f"invalid provider name '{name}': its module '{names.module}' is a Python keyword or "
                         f"standard-library module; choose another name")
    if importlib.util.find_spec(names.module) is not None:
        raise UsageError(f"invalid provider name '{name}': a module '{names.module}' is already importable here and "
                         f"the new package would clash with it; choose another name")
    return names


def check_directory(directory: Path) -> None:
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"{directory} exists and is not a directory; give a new or empty directory")
    if directory.is_dir() and any(directory.iterdir()):
        raise UsageError(f"{directory} is not empty; give a new or empty directory")


def check_not_installed(names: Names) -> None:
    """Two distributions registering one provider name make it unusable: refuse a name already installed."""
    from mimo.plugins import Registry

    claims = Registry().providers.get(names.provider)
    if claims:
        raise UsageError(f"a provider named '{names.provider}' is already installed (from "
                         f"{claims[0][1].distribution}); choose another name")


def render(text: str, names: Names, source: Path) -> str:
    for key, value in vars(names).items():
        text = text.replace("{{" + key + "}}", value)
    if "{{" in text:
        raise RuntimeError(f"template {source} has an unknown mark: {text[text.index('{{'):][:40]}")
    return text


def scaffold(name: str, directory: Path) -> list[Path]:
    """Write provider `name`'s package into `directory` (created; must be new or empty). Returns the files."""
    names = check_name(name)
    check_directory(directory)
    check_not_installed(names)
    written = []
    for source in sorted(TEMPLATES.rglob("*.tmpl")):
        relative = source.relative_to(TEMPLATES).with_suffix("")  # drop .tmpl
        if relative.parts[0] == "package":
            relative = Path(names.module, *relative.parts[1:])
        target = directory / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render(source.read_text(), names, source))
        written.append(target)
    return written


def new_provider(
    name: str = typer.Argument(..., help="provider name: lowercase letters, digits, hyphens (e.g. my-vlm)"),
    directory: Optional[Path] = typer.Argument(None, help="where to write the package (default: ./NAME); "
                                                          "must be new or empty"),
):
    """Write a pip-installable provider package: settings, hooks that build a small encoder + GPT from
    megatron-core pieces, synthetic data, and tests that check it against mimo's contract."""
    from .common import fail

    directory = directory or Path(name)
    try:
        written = scaffold(name, directory)
    except UsageError as err:
        raise fail(str(err)) from None
    typer.echo(f"wrote provider '{name}' to {directory} ({counted(len(written), 'file')}). Next:\n"
               f"  pip install -e {directory}\n"
               f"  pytest {directory}\n"
               f"  mimo run --provider {name} --train-iters 20 --device cpu")
