"""What every component's options share: `option` (a field with its `--help` text) and the `Options` base, whose
`validate()` checks the component's own fields."""

from __future__ import annotations

import math
from dataclasses import field, fields

from mimo.errors import UsageError


def option(default, help: str):
    return field(default=default, metadata={"help": help})


class Options:
    """Base of each component's options dataclass. `validate()` checks that component's fields alone (what needs
    another component's options is RunConfig.validate's); a component's own rules go in `check`."""

    def validate(self) -> None:
        # nan or inf in a numeric option would surface deep in a library as a traceback, or never (a nan lr trains)
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
        self.check()

    def check(self) -> None:
        """The component's own rules, each a one-line UsageError; none by default."""


def at_least_one(*named) -> None:
    """UsageError for the first (option, value) pair whose value is set and below 1."""
    for name, value in named:
        if value is not None and value < 1:
            raise UsageError(f"{name} must be at least 1, got {value}")
