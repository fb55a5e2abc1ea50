"""--profile-dir: where the GPU waits (idle gaps by loop phase) and the CPU run's summary."""

import json
import re

from helpers import run_mimo

from mimo.core.telemetry.profiler import idle_by_phase, idle_gaps, kind_of


def test_idle_gaps_are_attributed_to_the_innermost_phase():
    kernels = [(0, 10), (5, 12), (20, 30), (50, 60)]  # overlapping kernels make one busy stretch
    phases = [(0, 35, "mimo/step"), (12, 18, "mimo/data"), (40, 70, "mimo/optimizer")]
    assert idle_gaps(kernels, phases) == [(12, 20), (30, 50), (60, 70)]
    # gap midpoints: 16 in data (inside step), 40 in optimizer, 65 in optimizer; microseconds -> ms per iteration
    assert idle_by_phase(kernels, phases, iterations=1) == {"mimo/optimizer": 0.03, "mimo/data": 0.008}


def test_kernel_kinds():
    assert kind_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT") == "matmul"
    assert kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert kind_of("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor>") == \
        "elementwise/other"


def test_profile_dir_writes_a_trace_and_a_summary(tmp_path):
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--train-iters", "4", "--log-interval", "4",
                      "--profile-dir", str(tmp_path / "prof"), "--profile-step-start", "2", "--profile-step-end", "3",
                      "--profile-with-stack")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "profile (2 iterations" in result.stdout
    summary = json.loads((tmp_path / "prof" / "summary_rank0.json").read_text())
    assert summary["iterations"] == 2 and summary["device"] == "cpu" and summary["top"]
    # the busiest operators name where they were launched: a source line of mimo or megatron-core, or a backward
    sites = [site["site"] for entry in summary["top"][:5] for site in entry.get("sites", [])]
    assert sites and all(re.search(r"\.py:\d+ |backward of ", site) for site in sites), sites
    assert " <- " in result.stdout
    trace = (tmp_path / "prof" / "trace_rank0.json").read_text()
    # the host's work after the optimizer's one wait, told apart (core/parallel/optim.py)
    assert '"mimo/optimizer-read"' in trace and '"mimo/optimizer-update"' in trace


def test_a_bad_profile_window_is_one_line():
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--profile-dir", "/tmp/x",
                      "--profile-step-start", "5", "--profile-step-end", "3")
    assert result.returncode == 2
    assert "--profile-step-start 5 and --profile-step-end 3 must satisfy 1 <= start <= end" in result.stderr
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--profile-with-stack")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith(
        "--profile-with-stack records stacks in a profile: add --profile-dir DIR")


def test_innermost_host_operation_at_a_moment():
    """The idle report names the innermost operation of the loop's thread at a gap (properly nested events)."""
    from mimo.core.telemetry.profiler import _innermost

    events = sorted([(0, 100, "outer"), (10, 20, "first"), (30, 60, "second"), (40, 50, "inner")])
    starts = [e[0] for e in events]
    assert _innermost(events, starts, 45) == "inner"
    assert _innermost(events, starts, 25) == "outer"  # between two children: still inside the outer operation
    assert _innermost(events, starts, 55) == "second"
    assert _innermost(events, starts, 150) == "(python)"


def test_sync_sites_count_waits_by_call_site_and_pass_other_warnings_on():
    """A synchronizing-call warning is counted at its Python call site; any other warning goes on as before."""
    import warnings

    from mimo.core.telemetry.sync_sites import SyncSites

    def wait_for_gpu():
        warnings.warn("called a synchronizing CUDA operation")

    with warnings.catch_warnings(record=True) as others:
        warnings.simplefilter("always")
        with SyncSites() as syncs:
            for _ in range(3):
                wait_for_gpu()
            warnings.warn("an unrelated notice")
    (site, count), = syncs.sites.items()
    assert count == 3 and "wait_for_gpu" in site and "test_profile.py" in site
    assert syncs.top(iterations=3) == [{"per_iteration": 1.0, "site": site}]
    assert [str(w.message) for w in others] == ["an unrelated notice"]


def test_launch_sites_name_the_source_line_or_the_backward_node():
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mimo.core.telemetry.launch_sites import launch_sites

    layer = torch.nn.Linear(8, 8)

    def forward(x):
        return torch.relu(layer(x)) * 3.0

    x = torch.randn(64, 8, requires_grad=True)
    for with_stack in (True, False):
        with profile(activities=[ProfilerActivity.CPU], with_stack=with_stack) as prof:
            forward(x).sum().backward()
        sites = launch_sites(prof.events(), on_gpu=False, iterations=1, kernels=["aten::mul", "aten::mm"])
        # Forward and backward each launch one multiply of the same size: either may be the busier site.
        multiplies = [s["site"] for s in sites["aten::mul"]]
        if with_stack:
            assert any(re.search(r"test_profile\.py:\d+ forward \(aten::mul\)", m) for m in multiplies), multiplies
        assert any(m.startswith("backward of MulBackward0 (aten::mul)") for m in multiplies), multiplies
        assert any(s["site"].startswith("backward of AddmmBackward0 (aten::mm)") for s in sites["aten::mm"]), sites
