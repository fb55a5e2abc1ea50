"""--init-device where a CPU can check it: the refusal (one line, before any process) and where each choice draws
the weights. Drawing on the GPU (megatron-core's RNG tracker reseeded per module with that module's TP, EP and
expert-TP ranks: core/parallel/model.py `seed_tracker`) runs on GPUs only: docs/benchmarks/layouts_gpu.json."""

from __future__ import annotations

import pytest

from mimo.core.config import RunConfig, TrainingOptions
from mimo.core.run.plan import prepare
from mimo.errors import UsageError


def test_cuda_on_a_cpu_run_is_refused_in_one_line():
    config = RunConfig(provider="mock-vlm", training=TrainingOptions(device="cpu", init_device="cuda"))
    with pytest.raises(UsageError) as err:
        config.validate()
    assert str(err.value) == "--init-device cuda needs a GPU run: drop it, or use --device cuda"


@pytest.mark.parametrize("init_device, on_gpu, on_cpu", [
    ("auto", True, False), ("auto", False, True), ("cpu", True, True), ("cuda", True, False)])
def test_where_the_weights_are_drawn(init_device, on_gpu, on_cpu):
    plan = prepare(RunConfig(provider="mock-vlm", training=TrainingOptions(init_device=init_device)), world_size=1)
    assert plan.build_context({}, on_gpu=on_gpu).init_on_cpu is on_cpu
