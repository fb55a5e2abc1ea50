"""Weight gradients added into `main_grad` where they are computed (core/parallel/wgrad_fusion.py): megatron-core's
linear layers and embedding at TP 1 give the gradients of megatron-core's own backward, with no separate weight
gradient for DDP's hook to add; a whole run trains the same model with and without it."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

from helpers import read_metrics, run_mimo, start_world


def _layers():
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
    )
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    group = torch.distributed.new_group([0])
    init = torch.nn.init.normal_
    return torch.nn.ModuleDict({
        "embedding": VocabParallelEmbedding(32, 8, init_method=init, config=config, tp_group=group),
        "column": ColumnParallelLinear(8, 16, config=config, init_method=init, bias=True, gather_output=False,
                                       tp_group=group),
        "row": RowParallelLinear(16, 8, config=config, init_method=init, bias=False, input_is_parallel=True,
                                 skip_bias_add=False, tp_group=group),
    })


def _backward(layers, ids):
    hidden = layers["embedding"](ids)
    hidden, _ = layers["column"](hidden)
    out, _ = layers["row"](torch.relu(hidden))
    (out ** 2).sum().backward()


def _with_main_grads(module):
    for p in module.parameters():  # what megatron-core's DDP gives every parameter
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        p.grad_added_to_main_grad = False
    return module


def _compare() -> dict:
    from mimo.core.parallel.wgrad_fusion import fuse_weight_gradient_accumulation

    torch.manual_seed(0)
    reference = _layers()
    fused, unhooked = _with_main_grads(_layers()), _with_main_grads(_layers())
    fused.load_state_dict(reference.state_dict())
    unhooked.load_state_dict(reference.state_dict())
    changed = fuse_weight_gradient_accumulation(fused)
    fuse_weight_gradient_accumulation(unhooked, hooks_needed=False)
    # two micro-batches, token 3 repeated within and across them
    batches = [torch.tensor([[3, 5, 3, 7]]), torch.tensor([[3, 1, 2, 9]])]
    for ids in batches:
        for layers in (reference, fused, unhooked):
            _backward(layers, ids)
    result = {"changed": changed, "errors": {}, "flags": {}, "autograd_grads": {}}
    for (name, ref), (_, p), (_, q) in zip(reference.named_parameters(), fused.named_parameters(),
                                           unhooked.named_parameters()):
        # what DDP's hook would add: autograd's gradient, where the layer did not add it itself
        added = p.main_grad if p.grad_added_to_main_grad else p.main_grad + p.grad
        result["errors"][name] = (added - ref.grad).abs().max().item()
        result["flags"][name] = bool(p.grad_added_to_main_grad)
        # where DDP's hook is optional the layer hands autograd nothing for the weights it added
        result["autograd_grads"][name] = q.grad is not None
        unhooked_added = q.main_grad if q.grad_added_to_main_grad else q.main_grad + q.grad
        result["errors"][f"{name} (no hook)"] = (unhooked_added - ref.grad).abs().max().item()
    torch.distributed.destroy_process_group()
    return result


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.distributed.init_process_group("gloo")
    with open(out, "w") as f:
        json.dump(_compare(), f)


def test_megatron_layers_add_their_weight_gradients_into_main_grad(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "result.json"
    start_world(_worker, (port, str(out)), 1)
    result = json.loads(out.read_text())
    assert result["changed"] == 3
    # every weight's gradient is in main_grad, as megatron-core's backward computes it, and DDP's hook is told
    # to add nothing; the column layer's bias still takes autograd's way
    for name, error in result["errors"].items():
        assert error < 1e-5, (name, error)
    assert result["flags"] == {"embedding.weight": True, "column.weight": True, "column.bias": False,
                               "row.weight": True}
    assert result["autograd_grads"] == {"embedding.weight": False, "column.weight": False, "column.bias": True,
                                        "row.weight": False}


def test_stacked_expert_weights_add_their_gradients_into_main_grad():
    """A grouped GEMM's stacked weights: the stacked gradient lands in each weight's main_grad, in one call, and
    autograd gets a placeholder (DDP's hook needed) or nothing (optional); without main_grad, a plain stack."""
    from mimo.plugins.kit.main_grad import stacked

    torch.manual_seed(0)
    x = torch.randn(5, 4).bfloat16()
    reference = [torch.nn.Parameter(torch.randn(3, 4).bfloat16()) for _ in range(3)]
    (torch.stack(reference) @ x.t()).float().square().sum().backward()
    for optional in (False, True):
        weights = [torch.nn.Parameter(w.detach().clone()) for w in reference]
        for w in weights:
            w.main_grad, w.add_into_main_grad, w.main_grad_hook_optional = torch.zeros(3, 4), True, optional
        (stacked(weights) @ x.t()).float().square().sum().backward()
        for w, ref in zip(weights, reference):
            assert torch.equal(w.main_grad, ref.grad.float())
            assert w.grad_added_to_main_grad and (w.grad is None) == optional
    plain = [torch.nn.Parameter(w.detach().clone()) for w in reference]
    (stacked(plain) @ x.t()).float().square().sum().backward()
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(plain, reference))


def test_a_run_trains_the_same_model_with_and_without_it(tmp_path):
    losses = {}
    for flag in ("--grad-accum-fusion", "--no-grad-accum-fusion"):
        metrics = tmp_path / f"{flag}.jsonl"
        result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--train-iters", "3",
                          "--num-microbatches", "2", "--log-interval", "1", "--metrics-file", str(metrics), flag)
        assert result.returncode == 0, result.stderr[-2000:]
        losses[flag] = [r["lm_loss"] for r in read_metrics(metrics)]
    assert losses["--grad-accum-fusion"] == pytest.approx(losses["--no-grad-accum-fusion"], rel=1e-5)
