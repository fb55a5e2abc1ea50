"""Integer settings refuse 0 and negative values with one line, before any hook sees them.

An integer setting is taken for a size or a count (layers, widths, heads, lengths) unless its declared `minimum`
says that 0 or negative values mean something (`minimum=0` for "0: none"). A value below that is tried through
`build_settings`, as `mimo run --set` passes it: it must be a UsageError of one line naming the setting, never a
crash in `__post_init__` (a ZeroDivisionError) nor a model built with a negative width."""

from __future__ import annotations

import dataclasses
import types
import typing

from mimo.errors import UsageError
from mimo.plugins.settings import build_settings

from .report import ContractError
from .subject import Subject


def integer_settings(settings_cls: type) -> list[str]:
    """Settings typed `int` or `int | None`."""
    hints = typing.get_type_hints(settings_cls)

    def is_int(kind) -> bool:
        if kind is int:
            return True
        origin = typing.get_origin(kind)
        return origin in (typing.Union, types.UnionType) and set(typing.get_args(kind)) == {int, type(None)}

    return [f.name for f in dataclasses.fields(settings_cls) if is_int(hints[f.name])]


def check_size_settings(subject: Subject) -> list[str]:
    """Every integer setting refuses 0 and -1 (or those below its declared minimum) with one line naming it.
    Returns the settings checked."""
    provider = subject.provider
    fields = {f.name: f for f in dataclasses.fields(provider.settings)}
    checked = []
    for name in integer_settings(provider.settings):
        minimum = fields[name].metadata.get("minimum")
        for value in (v for v in (0, -1) if minimum is None or v < minimum):
            assignment = f"{name}={value}"
            try:
                build_settings(provider, [*subject.assignments, assignment])
            except UsageError as err:
                text = str(err)
                if "\n" in text.strip() or name not in text:
                    raise ContractError("settings", f"--set {assignment} is refused, but not in one line naming "
                                                    f"'{name}': {text!r}") from None
                continue
            except Exception as err:  # noqa: BLE001 - a crash instead of a refusal is what this check finds
                raise ContractError("settings", f"--set {assignment} raised {type(err).__name__}: {err} (declare "
                                                f"minimum=1 in the field's metadata)") from None
            hint = "; 0 means none? declare minimum=0" if value == 0 else ""
            raise ContractError("settings", f"--set {assignment} is accepted: an integer size setting must refuse 0 "
                                            f"and negative values (declare minimum=1 in the field's metadata{hint})")
        checked.append(name)
    return checked
