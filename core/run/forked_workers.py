"""The workers of a CPU run, forked from their launcher, which has imported torch and megatron-core already.

A worker started as a fresh interpreter spends seconds of a core importing torch, megatron-core and energon before
it does anything, and the workers of one machine pay it together on its shared cores (about 4 s each on two cores,
most of a short run). On CPU, mimo's launcher imports what its workers need once (the command names the modules)
and torch's elastic agent forks the workers from it (its "fork" start method). Each worker then drops what it
inherited from the launcher's command (atexit handlers, the agent's signal handlers), leads a session of its own
(a terminal's Ctrl-C reaches the launcher only, which passes the stop on, as with spawned workers), runs exactly
what `python -m mimo.cli ARGS` runs, and ends as an interpreter does (threads joined, atexit handlers run).

On GPUs the workers stay fresh interpreters (spawned): CUDA cannot be used in a process forked from one that
had touched it.
"""

from __future__ import annotations

import atexit
import importlib
import os
import runpy
import signal
import sys
import threading
import traceback

from .peer_loss import lost_peer_line


def import_modules(names: list[str]) -> None:
    """Import, in the launcher, what its workers will import: they are forked with it."""
    for name in names:
        importlib.import_module(name)


def run_worker(*argv: str) -> None:
    """One worker: `mimo ARGV` as `python -m mimo.cli` runs it (the launcher's environment plus the rank's)."""
    atexit._clear()  # the launcher's (its save lock, its own streams): it runs them itself
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_DFL)  # the agent's raise its SignalException; mimo sets its own
    os.setsid()
    code = run_cli(list(argv))
    if code:
        raise SystemExit(code)  # the process's exit code, which the launcher reports


def run_cli(argv: list[str]) -> int:
    """Run `mimo ARGV` in this (forked) process as `python -m mimo.cli` would, and end as an interpreter does:
    non-daemon threads joined, then atexit handlers, streams flushed. Returns the exit code."""
    sys.argv = ["mimo", *argv]  # runpy puts the module's file first, as `python -m` does
    code = 0
    try:
        runpy.run_module("mimo.cli", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException as err:  # what the interpreter prints for an uncaught exception
        line = lost_peer_line(err)
        if line is None:
            traceback.print_exc()
        else:
            print(line, file=sys.stderr)
        code = 1
    finally:
        threading._shutdown()  # the interpreter's own order at exit: threads, then atexit handlers
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    return code


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
