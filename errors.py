"""The one error type for bad input: the CLI prints its message as a single line and exits 2."""


class UsageError(Exception):
    """A user-fixable problem: bad option, unknown provider or setting, invalid layout, bad checkpoint."""
