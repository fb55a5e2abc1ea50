"""Every process mimo starts ends with its parent, whatever killed the parent (SIGKILL included).

* Forked children (energon's / torch's DataLoader workers, megatron-core's async checkpoint writer) get
  `PR_SET_PDEATHSIG` = SIGKILL from an at-fork hook: the kernel kills them when the thread that forked them ends.
  A child forked from another thread than the main one (where the thread may end before the process) polls its
  parent instead. torch's workers would otherwise notice only every 5 s; megatron-core's writer never.
* megatron-core's checkpoint results go through a queue without a process (core/checkpoint/results_queue.py):
  its Manager server and resource tracker outlived a killed run by minutes.
* Workers of mimo's own launcher (spawned, in sessions of their own) get SIGTERM when the launcher dies, so they
  stop at the next boundary and save (launch.die_with_launcher); a watchdog ends one that is still running
  `ORPHAN_GRACE_S` seconds later (a save it could not finish is removed at the next start: layout.py).

`install()` is the first thing each command that trains, evaluates or converts does.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["ORPHAN_GRACE_S", "install", "watch_parent"]

ORPHAN_GRACE_S = 8.0  # a launcher worker's time to save after its launcher died, before it ends itself
_POLL_S = 0.5
PR_SET_PDEATHSIG = 1
_state: dict = {"installed": False, "parent": None, "main": True}


def _before_fork() -> None:
    _state["parent"] = os.getpid()
    _state["main"] = threading.current_thread() is threading.main_thread()


def _in_child() -> None:
    parent = _state["parent"]
    if _state["main"]:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # it died before the request took effect
            os._exit(1)
    else:  # PDEATHSIG follows the forking thread, which may end long before its process
        watch_parent(parent, grace=0.0)


def watch_parent(parent: int, grace: float) -> None:
    """A daemon thread that ends this process `grace` seconds after `parent` is no longer its parent."""
    def watch():
        while os.getppid() == parent:
            time.sleep(_POLL_S)
        time.sleep(grace)
        os._exit(1)

    threading.Thread(target=watch, name="mimo-lifeline", daemon=True).start()


def install() -> None:
    """Children forked from now on die with this process; checkpoint saves start no helper process."""
    if _state["installed"] or not sys.platform.startswith("linux"):
        return
    _state["installed"] = True
    os.register_at_fork(before=_before_fork, after_in_child=_in_child)
    from ..checkpoint import results_queue

    results_queue.install()
