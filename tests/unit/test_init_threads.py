"""A GPU run draws its initial weights on the CPU with more threads than training uses (core/parallel/model.py
`init_threads`): the weights must not depend on the thread count, and training's count must come back."""

from __future__ import annotations

import pytest
import torch

from helpers import world_of_one
from mimo.core.config import RunConfig, TrainingOptions
from mimo.core.parallel.model import init_threads
from mimo.core.run.plan import prepare
from mimo.core.run.world import join


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


def _weights(provider: str, threads: int) -> dict[str, torch.Tensor]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plan = prepare(RunConfig(provider=provider, training=TrainingOptions(device="cpu", micro_batch_size=1)),
                       world_size=1)
        return {k: v.detach().clone() for k, v in join(plan).build_model().state_dict().items()
                if isinstance(v, torch.Tensor)}
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("provider", ["mock-vlm", "nemotron-moe-vlm-tiny"])
def test_initial_weights_do_not_depend_on_the_thread_count(world, provider):
    one, two = _weights(provider, 1), _weights(provider, 2)
    assert one.keys() == two.keys() and len(one) > 10
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_threads_raised_to_the_ranks_share_then_restored(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    training = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with init_threads(True):
            assert torch.get_num_threads() == 16
        assert torch.get_num_threads() == 1
        with init_threads(False):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(training)
