"""--gc-interval: Python's garbage collector during training, and the time it takes in the logs."""

import gc
import weakref

from helpers import read_metrics, run_mimo

from mimo.core.run.garbage import GarbageCollection
from mimo.core.telemetry.gc_pauses import GcPauses


class Node:
    pass


def _cycle():
    """A reference cycle, reachable only through the returned weak reference: only a collection frees it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_an_interval_collects_at_its_iterations_only_and_restores_the_collector():
    assert gc.isenabled()
    garbage = GarbageCollection(3)
    garbage.start()
    try:
        assert not gc.isenabled() and gc.get_freeze_count() > 0  # start-up's objects frozen, passes off
        ref = _cycle()
        for _ in range(5000):  # far past the collector's threshold: it would have run if it were on
            _cycle()
        garbage.after(1)
        garbage.after(2)
        assert ref() is not None
        garbage.after(3)
        assert ref() is None
    finally:
        garbage.stop()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_without_an_interval_the_collector_is_left_as_it_is():
    garbage = GarbageCollection(0)
    garbage.start()
    try:
        assert gc.isenabled() and gc.get_freeze_count() == 0
        garbage.after(100)
    finally:
        garbage.stop()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_pauses_sum_the_collectors_passes():
    meter = GcPauses()
    try:
        meter.take()
        gc.collect()
        gc.collect()
        seconds, passes = meter.take()
        assert passes == 2 and seconds > 0
        assert meter.take() == (0.0, 0)
    finally:
        meter.close()
    gc.collect()
    assert meter.passes == 0  # closed: no longer called


def test_a_run_logs_its_collector_time_and_refuses_a_negative_interval(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--train-iters", "4", "--log-interval", "2",
             "--gc-interval", "2", "--metrics-file", str(metrics))
    records = [r for r in read_metrics(metrics) if r["split"] == "train"]
    assert [r["iteration"] for r in records] == [2, 4]
    # each interval holds the loop's collection (a library may make one more of its own: a fresh-clone CI run saw
    # one; the exact schedule is test_an_interval_collects_at_its_iterations_only_and_restores_the_collector's)
    assert all(r["gc_passes"] >= 1 and r["gc_ms"] > 0 for r in records), records

    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--gc-interval", "-1")
    assert result.returncode != 0
    assert "--gc-interval must be 0 (automatic collection) or a number of iterations, got -1" in result.stderr
    assert "Traceback" not in result.stderr
