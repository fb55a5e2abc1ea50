"""The one error type for bad input: the CLI prints its message as a single line and exits 2."""


class UsageError(Exception):
    """A user-fixable problem: bad option, unknown provider or setting, invalid layout, bad checkpoint."""


class TrainingStopped(Exception):
    """Training cannot go on (e.g. too many non-finite iterations in a row): the CLI prints one line, exits 1."""
