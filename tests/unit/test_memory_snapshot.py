"""`--memory-snapshot-dir`'s report (core/telemetry/memory_snapshot.py): the peak of an allocator history in
torch's snapshot format, and what was live then, by the code that allocated it."""

from __future__ import annotations

import pytest

from mimo.core.config import LoggingOptions, RunConfig, TrainingOptions
from mimo.core.telemetry.memory_snapshot import allocation_site, peak_report
from mimo.errors import UsageError

TORCH = {"filename": "/x/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}


def frames(where: str) -> list[dict]:
    return [{"filename": "/x/site-packages/torch/_tensor.py", "line": 9, "name": "new_empty"},
            {"filename": f"/x/site-packages/megatron/{where}.py", "line": 7, "name": where}, TORCH]


def test_the_peak_and_what_was_live_then():
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": frames("weights")},
        {"action": "alloc", "addr": 2, "size": 50, "frames": frames("activations")},
        {"action": "alloc", "addr": 3, "size": 30, "frames": frames("activations")},  # 180
        {"action": "free_requested", "addr": 2, "size": 50, "frames": frames("free")},
        {"action": "free_completed", "addr": 2, "size": 50, "frames": []},
        {"action": "alloc", "addr": 4, "size": 60, "frames": frames("optimizer")},  # the peak: 100 + 30 + 60
        {"action": "free_requested", "addr": 3, "size": 30, "frames": []},
    ]
    # blocks live at the dump: 1 and 4, and one from before recording began (40 bytes)
    segments = [{"device": 0, "blocks": [{"size": 100, "state": "active_allocated"},
                                         {"size": 60, "state": "active_allocated"},
                                         {"size": 40, "state": "active_allocated"},
                                         {"size": 30, "state": "inactive"}]}]
    report = peak_report({"device_traces": [trace], "segments": segments})
    assert report["before_recording_bytes"] == 40
    assert report["peak_bytes"] == 190 + 40 and report["peak_event"] == 5
    assert [(s["site"], s["bytes"], s["blocks"]) for s in report["sites"]] == [
        ("megatron/weights.py:7 weights", 100, 1), ("megatron/optimizer.py:7 optimizer", 60, 1),
        ("megatron/activations.py:7 activations", 30, 1)]


def test_the_allocating_site_skips_torch_itself():
    assert allocation_site([TORCH]) == "(torch internals or no stack)"
    assert allocation_site(frames("layer")) == "megatron/layer.py:7 layer"


def test_a_cpu_run_is_refused_a_memory_snapshot_in_one_line(tmp_path):
    config = RunConfig(provider="mock-vlm", training=TrainingOptions(device="cpu"),
                       logging=LoggingOptions(memory_snapshot_dir=tmp_path))
    with pytest.raises(UsageError, match="--memory-snapshot-dir records the GPU allocator"):
        config.validate()
