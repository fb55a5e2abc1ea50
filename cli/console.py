"""What reaches the console: mimo's own lines on stdout, its errors on stderr, and nothing else.

The libraries mimo drives announce things a user need not act on: megatron-core that Transformer Engine or Apex
is missing, torch that it found no CUDA runtime or that `pin_memory` has no accelerator, energon's progress bars
and prepare notes, megatron-core's "common state dict differs" during a save. `configure` (called once per
process, before any of them is imported) sends every Python warning raised outside mimo, and every library log
record below ERROR, to mimo's debug log instead of the console. The debug log goes nowhere by default,
to stderr with `mimo --verbose`, and to a file with `mimo --log-file FILE`; both are inherited by the worker
processes mimo starts (through the environment), so every rank behaves the same.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from pathlib import Path

VERBOSE_ENV = "MIMO_VERBOSE"
LOG_FILE_ENV = "MIMO_LOG_FILE"
DEBUG_LOG = logging.getLogger("mimo.debug")  # where library notices go
# Loggers that carry their own handlers (torch's glog-style ones) or that torch sets to a level of its own:
# level ERROR keeps their notices off the console whatever handler they have.
_SELF_HANDLED = ("torch.utils.cpp_extension", "torch.distributed.elastic", "torch._dynamo", "torch._inductor")


class _Route(logging.Handler):
    """The root logger's only handler: library records below ERROR to the debug log, the rest to stderr."""

    def __init__(self, debug_sink: logging.Handler | None):
        super().__init__(logging.DEBUG)
        self.debug_sink = debug_sink
        self.console = logging.StreamHandler(sys.stderr)
        self.console.setFormatter(logging.Formatter("%(levelname)s (%(name)s): %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        ours = record.name == "mimo" or record.name.startswith("mimo.") and record.name != DEBUG_LOG.name
        if record.levelno >= logging.ERROR or (ours and record.levelno >= logging.WARNING):
            self.console.handle(record)
        elif self.debug_sink is not None:
            self.debug_sink.handle(record)


def _debug_sink() -> logging.Handler | None:
    path, verbose = os.environ.get(LOG_FILE_ENV), os.environ.get(VERBOSE_ENV) == "1"
    if path:
        sink = logging.FileHandler(path, encoding="utf-8")
    elif verbose:
        sink = logging.StreamHandler(sys.stderr)
    else:
        return None
    sink.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    return sink


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Python warnings go to the debug log. mimo itself never warns through them (it prints its own lines), and a
    library's warning names the caller's file (stacklevel), often mimo's, so the file says nothing about whose
    notice it is."""
    DEBUG_LOG.debug("%s:%s: %s: %s", filename, lineno, category.__name__, message)


def configure(verbose: bool = False, log_file: Path | None = None) -> None:
    """Route the libraries' notices for this process and the processes it starts."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    if log_file is not None:
        os.environ[LOG_FILE_ENV] = str(Path(log_file).absolute())
    # energon's "Filling reading buffer" bars (tqdm, in loader workers, which inherit the environment)
    os.environ.setdefault("TQDM_DISABLE", "1")
    sink = _debug_sink()
    root = logging.getLogger()
    root.handlers = [_Route(sink)]  # later logging.basicConfig calls (libraries') then do nothing
    root.setLevel(logging.INFO)
    DEBUG_LOG.setLevel(logging.DEBUG)  # the notices routed here, whatever the libraries' levels
    for name in _SELF_HANDLED:
        logging.getLogger(name).setLevel(logging.WARNING if os.environ.get(VERBOSE_ENV) == "1" else logging.ERROR)
    warnings.showwarning = _show_warning


def debug_enabled() -> bool:
    return bool(os.environ.get(LOG_FILE_ENV) or os.environ.get(VERBOSE_ENV) == "1")


@contextlib.contextmanager
def prints_to_debug_log(what: str):
    """Send what a library `print`s meanwhile (energon's prepare notes) to the debug log."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        yield
    for line in buffer.getvalue().splitlines():
        if line.strip():
            DEBUG_LOG.debug("%s: %s", what, line)
