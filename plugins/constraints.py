"""Declared constraints on provider settings: bounds and relations in each field's metadata, one checker for all.

A provider declares them where the field is defined, beside its help text:

    hidden_size: int = field(default=64, metadata={"help": "...", "minimum": 1})
    num_attention_heads: int = field(default=4, metadata={"help": "...", "minimum": 1, "divides": "hidden_size"})
    image_size: int = field(default=32, metadata={"help": "...", "multiple_of": "patch_size"})
    dropout: float = field(default=0.0, metadata={"help": "...", "minimum": 0.0, "maximum": 1.0})
    mamba_conv_kernel: int = field(default=4, metadata={"help": "...", "choices": (2, 3, 4)})

or with `mimo.setting(default, help, minimum=1, divides="hidden_size")`, which writes that metadata. `divides` and
`multiple_of` name another setting (or a list of them), or give a number. A setting whose value is None is not
checked (an optional size left to its default), nor a relation with a setting that is None.

`check` runs before the settings dataclass is built, so `__post_init__` only says what code must (relations of
derived values) and never meets a zero it would divide by. `mimo providers show` lists the rules (`rules`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from mimo.errors import UsageError

from .hints import suggest

BOUNDS = ("minimum", "maximum", "choices")
RELATIONS = ("divides", "multiple_of")
KEYS = BOUNDS + RELATIONS


def setting(default=dataclasses.MISSING, help: str = "", *, minimum=None, maximum=None, choices=None,
            divides=None, multiple_of=None, default_factory=dataclasses.MISSING):
    """A settings field with its help text and declared constraints (None: not declared)."""
    declared = {"minimum": minimum, "maximum": maximum, "choices": tuple(choices) if choices is not None else None,
                "divides": divides, "multiple_of": multiple_of}
    metadata = {"help": help, **{k: v for k, v in declared.items() if v is not None}}
    return field(default=default, default_factory=default_factory, metadata=metadata)


def declared(settings_cls: type) -> dict[str, dict[str, Any]]:
    """{setting: {rule: value}} for every setting that declares a rule, after checking the declarations."""
    names = [f.name for f in dataclasses.fields(settings_cls)]
    rules = {}
    for f in dataclasses.fields(settings_cls):
        own = {k: f.metadata[k] for k in KEYS if k in f.metadata}
        for key in f.metadata:
            if key not in KEYS and key != "help" and suggest(key, KEYS):  # a misspelt rule is never ignored
                raise UsageError(f"{settings_cls.__name__}.{f.name} declares metadata '{key}'{suggest(key, KEYS)}")
        for relation in RELATIONS:
            for other in _others(own.get(relation)):
                if isinstance(other, str) and other not in names:
                    raise UsageError(f"{settings_cls.__name__}.{f.name} declares {relation} '{other}', which is not "
                                     f"a setting{suggest(other, names)}")
        if own:
            rules[f.name] = own
    return rules


def check(settings_cls: type, values: dict[str, Any], provider_name: str) -> None:
    """Raise UsageError (one line: setting, value, rule) at the first value that breaks a declared rule.

    `values` holds every setting (defaults filled in). Bounds are checked for all settings before relations, so a
    zero is named as out of range rather than met as a divisor."""
    rules = declared(settings_cls)
    for name, own in rules.items():
        value = values.get(name)
        if value is None:
            continue
        if "choices" in own and value not in tuple(own["choices"]):
            _refuse(provider_name, name, value, f"must be one of {', '.join(repr(c) for c in own['choices'])}")
        if "minimum" in own and _below(value, own["minimum"]):
            _refuse(provider_name, name, value, f"must be at least {own['minimum']}")
        if "maximum" in own and _below(own["maximum"], value):
            _refuse(provider_name, name, value, f"must be at most {own['maximum']}")
    for name, own in rules.items():
        value = values.get(name)
        for other in _others(own.get("divides")) if value is not None else ():
            target, label = _resolve(other, values)
            if target is not None and value != 0 and target % value:
                _refuse(provider_name, name, value, f"must divide {label}")
        for other in _others(own.get("multiple_of")) if value is not None else ():
            base, label = _resolve(other, values)
            if base not in (None, 0) and value % base:
                _refuse(provider_name, name, value, f"must be a multiple of {label}")


def describe(own: dict[str, Any]) -> str:
    """One setting's rules as `mimo providers show` prints them: '>= 1, divides hidden_size'."""
    parts = []
    if "minimum" in own:
        parts.append(f">= {own['minimum']}")
    if "maximum" in own:
        parts.append(f"<= {own['maximum']}")
    if "choices" in own:
        parts.append("one of " + ", ".join(repr(c) for c in own["choices"]))
    parts += [f"divides {o}" for o in _others(own.get("divides"))]
    parts += [f"multiple of {o}" for o in _others(own.get("multiple_of"))]
    return ", ".join(parts)


def _others(declared_value) -> list:
    if declared_value is None:
        return []
    return list(declared_value) if isinstance(declared_value, (list, tuple)) else [declared_value]


def _resolve(other, values: dict) -> tuple[Any, str]:
    """A relation's other side: a setting's value (None when unset) or a number; and how the rule names it."""
    if isinstance(other, str):
        return values.get(other), f"{other} ({values.get(other)!r})"
    return other, str(other)


def _below(a, b) -> bool:
    try:
        return a < b
    except TypeError:  # a list against a number: the type check names it, not this rule
        return False


def _refuse(provider_name: str, name: str, value, rule: str):
    raise UsageError(f"setting '{name}' of provider '{provider_name}' is {value!r}: it {rule}")
