"""energon's per-sample prints go to mimo's debug log instead of the console.

When a sample fails, energon 7.4.1's `ErrorContext` (megatron/energon/errors.py) prints `Except <error> in
<stage>` and, for failures in a row, `ErrorContext <stage> failed n/100 times in a row.`, with `print`, whatever
error handler the WorkerConfig has; its default handler (`log_exception`, which mimo replaces with its skip counter)
adds a traceback and a dump of the sample, about 40 lines per bad sample. energon has no setting for these prints.
mimo says what it skipped in one line per sample itself (`core/telemetry/skip_report.py`), so `route_energon_prints` puts a thin
filter on this process's stdout: what energon's errors module prints goes to the `mimo.data.energon` logger at
debug level (configure logging to see it), everything else passes through unchanged. Loader worker processes are
forked after the loader starts and inherit the filter.
"""

from __future__ import annotations

import logging
import sys
import threading

__all__ = ["LOGGER", "route_energon_prints"]

LOGGER = logging.getLogger("mimo.data.energon")


class _EnergonPrintFilter:
    """A text stream that sends the writes of one source file's `print` calls to LOGGER, the rest to `stream`."""

    def __init__(self, stream, source_file: str):
        self._stream = stream
        self._source_file = source_file
        self._partial = threading.local()  # a print writes its text and its line end separately

    def write(self, text: str) -> int:
        # `print` is C code: the frame above this one is the Python code that called it
        if sys._getframe(1).f_code.co_filename != self._source_file:
            return self._stream.write(text)
        *lines, rest = (getattr(self._partial, "text", "") + text).split("\n")
        for line in lines:
            if line.strip():
                LOGGER.debug("energon: %s", line)
        self._partial.text = rest
        return len(text)

    def __getattr__(self, name):  # flush, fileno, isatty, encoding, buffer, ...: the wrapped stream's
        return getattr(self._stream, name)


def route_energon_prints() -> None:
    """Route energon's per-sample prints in this process (and in processes forked from it later) to LOGGER."""
    import megatron.energon.errors as energon_errors

    if not isinstance(sys.stdout, _EnergonPrintFilter):
        sys.stdout = _EnergonPrintFilter(sys.stdout, energon_errors.__file__)
