"""The optimizer step's one wait for the GPU (core/parallel/optim.py): on a heterogeneous world of two gloo
processes (the encoder on rank 0, the LLM on rank 1), no collective follows the update (megatron-core's world
reduction of its success made the host wait for the update itself), a veto from `before_update` and a non-finite
gradient on one rank skip the update on both, and a clean step updates and reports the global norm."""

from __future__ import annotations

import json
import math
import os
import socket
from unittest import mock

import torch

from helpers import start_world

from mimo.core.config import LaunchOptions, LayoutOptions, RunConfig, TrainingOptions
from mimo.core.run.plan import prepare


def _config() -> RunConfig:
    return RunConfig(provider="mock-vlm", launch=LaunchOptions(nproc_per_node=2),
                     training=TrainingOptions(micro_batch_size=1, num_microbatches=1, device="cpu"),
                     layout=LayoutOptions(encoder_ranks=1))


def _steps(rank: int) -> dict:
    from mimo.core.parallel.optim import build_optimizer
    from mimo.core.run.world import join

    cfg = _config()
    world = join(prepare(cfg, world_size=2), seed=1)
    model = world.build_model()
    from megatron.core.optimizer import clip_grads

    clip_calls = []  # megatron-core's clipping call, which walks every parameter on the host

    def clip(*args, **kwargs):
        clip_calls.append(True)
        return real_clip(*args, **kwargs)

    real_clip = clip_grads.clip_grad_by_total_norm_fp32
    with mock.patch.object(clip_grads, "clip_grad_by_total_norm_fp32", clip):
        optimizer = build_optimizer(cfg.optimizer, model=model, params_dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    collectives, updating, update_squares = [], [], []
    real_all_reduce, real_update = torch.distributed.all_reduce, optimizer.step_with_ready_grads

    def all_reduce(*args, **kwargs):
        collectives.append("after the update" if updating else "before")
        return real_all_reduce(*args, **kwargs)

    def update():
        updating.append(True)
        grads = [p.grad for opt in optimizer._active_optimizers for p in opt.get_parameters() if p.grad is not None]
        update_squares.append(sum(float(g.float().square().sum()) for g in grads))  # after clipping
        return real_update()

    def step(grad: float, veto: bool = False):
        for p in params:
            p.main_grad.fill_(grad)
        optimizer.before_update = lambda: veto
        before = [p.detach().clone() for p in params]
        collectives.clear()
        updating.clear()
        clip_calls.clear()
        with mock.patch.object(torch.distributed, "all_reduce", all_reduce), \
                mock.patch.object(optimizer, "step_with_ready_grads", update):
            ok, norm, _ = optimizer.step()
        changed = any(not torch.equal(b, p) for b, p in zip(before, params))
        squares = update_squares.pop() if update_squares else None
        return {"ok": ok, "norm": norm, "changed": changed, "collectives": list(collectives), "squares": squares,
                "clip_calls": len(clip_calls)}

    # a non-finite gradient on the LLM's rank only: both ranks learn it from the one reduction and skip
    results = {"clean": step(0.01), "vetoed": step(0.01, veto=True),
               "non_finite": step(math.inf if rank == 1 else 0.01)}
    results["module_norms"] = optimizer.module_grad_norms
    results["small"], results["elements"] = step(1e-7), sum(p.numel() for p in params)
    torch.distributed.destroy_process_group()
    return results


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    with open(f"{out}.{rank}", "w") as f:
        json.dump(_steps(rank), f)


def test_one_reduction_before_the_update_and_every_rank_skips_alike(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_world(_worker, (port, str(tmp_path / "r")), 2)
    ranks = [json.loads((tmp_path / f"r.{rank}").read_text()) for rank in range(2)]
    for rank, r in enumerate(ranks):
        clean = r["clean"]
        assert clean["ok"] and clean["changed"] and clean["norm"] > 0, rank
        assert "after the update" not in clean["collectives"] and clean["collectives"], rank
        for skipped in ("vetoed", "non_finite"):
            assert (r[skipped]["ok"], r[skipped]["norm"], r[skipped]["changed"]) == (False, None, False), (rank,
                                                                                                         skipped)
    # every rank reports the same global norm, the root of the modules' squares
    assert ranks[0]["clean"]["norm"] == ranks[1]["clean"]["norm"]
    norms = ranks[0]["module_norms"]
    assert set(norms) == {"images", "language"} and math.isinf(norms["language"])
    # clipping (clip_grad 1.0) with the global norm: a norm above it leaves a global norm of 1 for the update; one
    # below it leaves the gradients as they were (the host then skips megatron-core's clipping call altogether)
    assert ranks[0]["clean"]["norm"] > 1 > ranks[0]["small"]["norm"]
    assert math.isclose(sum(r["clean"]["squares"] for r in ranks), 1.0, rel_tol=1e-4)
    for r in ranks:
        assert math.isclose(r["small"]["squares"], r["elements"] * 1e-14, rel_tol=1e-4)
        assert r["clean"]["clip_calls"] >= 1 and r["small"]["clip_calls"] == 0


def test_module_norms_as_device_tensors_are_read_once(monkeypatch):
    """With transformer-engine's kernels megatron-core hands each module's norm back as a device tensor: the step
    copies them into its reduction on the device and reads the GPU once (`tolist`), never testing one for truth
    (which waited for the GPU once per module before the step's one wait)."""
    from types import SimpleNamespace

    from helpers import world_of_one
    from mimo.core.parallel.optim import _recording_optimizer_class

    def module(norm):
        return SimpleNamespace(is_active=True, optimizer=SimpleNamespace(get_grad_norm=lambda: norm))

    recording = SimpleNamespace(module_infos={"images": module(torch.tensor(3.0)), "language": module(torch.tensor(4.0)),
                                              "audio": module(None)})
    reads, depth = [], 0
    real_tolist = torch.Tensor.tolist

    def refuse(name):
        def read(self, *args):
            raise AssertionError(f"the host read a norm with {name}")
        return read

    def tolist(self):  # torch's own dispatch calls it again from within: one read counted per outer call
        nonlocal depth
        depth += 1
        try:
            return real_tolist(self)
        finally:
            depth -= 1
            if depth == 0:
                reads.append(self.numel())

    with world_of_one():
        cls = _recording_optimizer_class()
        for name in ("__bool__", "item", "__float__"):
            monkeypatch.setattr(torch.Tensor, name, refuse(name))
        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        found_inf = cls._module_norms(recording, False)
        monkeypatch.undo()
    assert reads == [4] and found_inf is False
    assert recording.module_grad_norms == {"audio": 0.0, "images": 3.0, "language": 4.0}
    assert recording.grad_norm == 5.0
