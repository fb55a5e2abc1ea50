"""A worker whose peers stopped first says one line (core/run/peer_loss.py); other errors keep their traceback."""

from __future__ import annotations

from mimo.core.run.peer_loss import lost_peer_line

GLOO = ("Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by "
        "peer [127.0.0.1]:51840. This is typically caused by a remote worker crashing.")


def test_a_lost_peer_is_one_line_naming_the_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    line = lost_peer_line(RuntimeError(GLOO))
    assert line == ("error: rank 1 stopped: another rank stopped first and closed its connections (its error is "
                    "above)")


def test_other_errors_keep_their_traceback():
    assert lost_peer_line(RuntimeError("shape mismatch: [8, 64] against [16, 64]")) is None
    assert lost_peer_line(ValueError("Connection closed by peer")) is None  # not a distributed backend's error
