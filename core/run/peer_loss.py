"""A worker whose peers stopped first: one line instead of a traceback.

When one rank of a run stops (a one-line error of its own, a crash), the others fail inside their next collective
or process-group set-up with an error from gloo or NCCL ("Connection closed by peer"). That traceback says nothing
the launcher's line about the rank that failed first does not, and buries that rank's own message; those ranks say
one line instead. Any other error keeps its traceback.
"""

from __future__ import annotations

import os

# what gloo and NCCL say when the other end of a connection went away
_SIGNS = ("Connection closed by peer", "Connection reset by peer", "connectFullMesh failed", "Broken pipe",
          "remote process exited", "communicator was aborted", "Connection refused")


def lost_peer_line(err: BaseException) -> str | None:
    """One line for an error that only says another rank stopped first, or None."""
    if not isinstance(err, RuntimeError):  # torch's DistBackendError and DistNetworkError are RuntimeErrors
        return None
    text = str(err)
    if not any(sign in text for sign in _SIGNS):
        return None
    rank = os.environ.get("RANK", "?")
    return f"error: rank {rank} stopped: another rank stopped first and closed its connections (its error is above)"
