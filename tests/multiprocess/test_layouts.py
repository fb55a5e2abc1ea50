"""Heterogeneous and colocated layouts train to the same losses and gradients as one process (CPU, gloo)."""

import itertools
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import read_metrics, run_mimo, shared_artifact

# Half the samples carry no image, so micro-batches without any image occur on encoder ranks.
COMMON = ("run", "--provider", "mock-vlm", "--device", "cpu", "--train-iters", "10", "--log-interval", "1",
          "--micro-batch-size", "2", "--global-batch-size", "12", "--set", "image_probability=0.5", "--seed", "5")
LAYOUTS = {
    "single": (),
    "colocated-dp2": ("--nproc-per-node", "2"),
    "encoder1-llm1": ("--nproc-per-node", "2", "--encoder-ranks", "1"),
    "encoder1-llm3dp": ("--nproc-per-node", "4", "--encoder-ranks", "1"),
    "encoder2tp-llm2dp": ("--nproc-per-node", "4", "--encoder-ranks", "2", "--encoder-tp", "2"),
    "encoder2dp-llm2dp": ("--nproc-per-node", "4", "--encoder-ranks", "2"),  # encoder DP ranks without images
    # fan-in (more encoder than LLM data-parallel ranks): the encoder ranks send different numbers of rows, and
    # each gets its own rows' gradient back (core/forward/fan_in.py)
    "encoder2dp-llm1": ("--nproc-per-node", "3", "--encoder-ranks", "2"),
    # fan-in to an LLM with TP 2, two samples per encoder rank with different image counts
    "encoder2dp-llm1tp2": ("--nproc-per-node", "4", "--encoder-ranks", "2", "--llm-tp", "2",
                           "--micro-batch-size", "4"),
}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """Every layout's metrics, the runs made once per test run (pytest tore the module's fixture down and built
    it again, 4 to 5 minutes each time, when a worker ran another file's test between two of these)."""

    def build(out):
        for name, args in LAYOUTS.items():
            result = run_mimo(*COMMON, *args, "--metrics-file", str(out / f"{name}.jsonl"))
            assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"

    out = shared_artifact(tmp_path_factory, "layout-runs", build)
    return {name: read_metrics(out / f"{name}.jsonl") for name in LAYOUTS}


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "single"])
def test_losses_and_module_gradients_match_one_process(layout_runs, layout):
    reference, other = layout_runs["single"], layout_runs[layout]
    assert len(other) == len(reference) == 10
    for ref, got in zip(reference, other):
        for key in ("lm_loss", "grad_norm_images", "grad_norm_language"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5), (layout, ref["iteration"], key)


def test_some_encoder_micro_batches_carry_no_image():
    """The parity runs above include image-free micro-batches on the encoder ranks (no hang, same gradient)."""
    from mimo.plugins import DataContext
    from mimo.providers.mock_vlm import MockVLMSettings
    from mimo.providers.mock_vlm.data import synthetic_batches

    # The single encoder rank of "encoder1-llm3dp" reads all three lanes: 6 samples per micro-batch; the LLM
    # lanes read 2. Count image-free micro-batches of one lane over the 10 iterations.
    ctx = DataContext(micro_batch_size=2, num_microbatches=2, num_lanes=3, seed=5, first_position=2)
    batches = itertools.islice(synthetic_batches(MockVLMSettings(image_probability=0.5), ctx), 20)
    assert sum(1 for b in batches if not b["modality_inputs"]) > 0


def test_a_dead_worker_stops_the_others_within_the_timeout(tmp_path):
    """Workers started as a launcher would (torchrun/srun environment); one is killed mid-run."""
    with socket.socket() as s:  # a free port: other tests may run at the same time
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "mimo.cli", "run", "--provider", "mock-vlm", "--device", "cpu",
            "--train-iters", "100000", "--log-interval", "1", "--nproc-per-node", "2", "--encoder-ranks", "1",
            "--distributed-timeout-minutes", "0.5"]
    workers = [subprocess.Popen(args, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        survivor, victim = workers[1], workers[0]  # rank 1 (the LLM) logs; kill the encoder rank
        for line in survivor.stdout:
            if line.startswith("iteration"):
                break
        victim.send_signal(signal.SIGKILL)
        started = time.monotonic()
        code = survivor.wait(timeout=120)
        assert code != 0 and time.monotonic() - started < 45
    finally:
        for w in workers:
            w.kill()
