"""Start `mimo` commands without paying for the imports each time.

Most of a short `mimo` command's time on CPU is the interpreter importing torch, megatron-core, energon and mimo's
training modules: about 5 s of a 6 s run, paid by hundreds of commands in the suite. Each pytest worker keeps one
stdlib forkserver that has done those imports once, as the server of a CPU run's workers does
(`mimo.cli.worker_imports`: the console's routing first, so the libraries' import-time notices go where a
command's go); a command is a process forked from it that then runs exactly what `python -m mimo.cli ARGS` runs:
stdout and stderr go to files, the process leads a session of its own, and it ends like an interpreter does
(non-daemon threads joined, atexit handlers run, streams flushed).

A command whose environment changes what is read at import (PYTHONPATH aside, which the command puts first on its
sys.path; TORCH_*, OMP_*, ...), or that shows the libraries' notices (--verbose, --log-file: the import-time ones
were routed away in the server), runs in a fresh interpreter instead, and MIMO_TEST_FRESH_PROCESSES=1 runs every
command that way."""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import subprocess
import sys

from mimo.core.run import forked_workers

PRELOAD = ["mimo.cli.worker_imports"]
# environment variables read while those modules are imported (or by the interpreter at start), or by the console
IMPORT_TIME_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "CUDA", "NVTE_", "TRITON", "LD_", "TQDM_",
                        "MIMO_VERBOSE", "MIMO_LOG_FILE")
SHOWS_NOTICES = ("--verbose", "-v", "--log-file")

_context: multiprocessing.context.ForkServerContext | None = None
_fresh_path: list[str] = []  # a fresh interpreter's sys.path after its first entry, without PYTHONPATH


def can_fork(args: list[str], environment: dict[str, str]) -> bool:
    """Whether this command behaves the same forked from the server as in a fresh interpreter."""
    if os.environ.get("MIMO_TEST_FRESH_PROCESSES") == "1" or any(arg.split("=")[0] in SHOWS_NOTICES for arg in args):
        return False
    return all(environment.get(key) == os.environ.get(key) for key in set(environment) | set(os.environ)
               if key.startswith(IMPORT_TIME_PREFIXES) and key != "PYTHONPATH")  # the command's sys.path takes it


def context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context whose server has imported PRELOAD (multiprocessing keeps one server per process:
    torch.multiprocessing.start_processes(..., start_method="forkserver") forks from it too, after this)."""
    global _context
    if _context is None:
        # torch imports tqdm, which reads TQDM_* when it is imported: the server imports it with the value mimo's
        # console sets for every command before torch loads (no progress bars), and commands get it passed on
        os.environ.setdefault("TQDM_DISABLE", "1")
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def start(args: list[str], environment: dict[str, str], cwd: str, stdout_path: str, stderr_path: str):
    """A started multiprocessing.Process running `mimo ARGS`; its pid leads a session (os.killpg reaches all)."""
    process_context = context()
    environment.setdefault("TQDM_DISABLE", os.environ["TQDM_DISABLE"])
    if not _fresh_path:
        environment_without_path = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        _fresh_path[:] = json.loads(subprocess.check_output(
            [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"], env=environment_without_path))
    process = process_context.Process(target=_run_mimo, daemon=False,
                               args=(list(args), dict(environment), cwd, stdout_path, stderr_path, list(_fresh_path)))
    process.start()
    return process


def _run_mimo(args, environment, cwd, stdout_path, stderr_path, fresh_path) -> None:
    os.setsid()
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    # the pytest worker's sys.path (the repository, tests/) is not the command's
    sys.path[:] = [cwd] + [entry for entry in environment.get("PYTHONPATH", "").split(os.pathsep) if entry] + fresh_path
    importlib.invalidate_caches()
    os._exit(forked_workers.run_cli(list(args)))
