"""The memory estimate (core/memory/estimate.py) against what megatron-core really allocates, and the --gpu-memory check.

The buffers are megatron-core's own: the models are built on the CPU under its DDP (fp32 gradient buffers) and
optimizers (Adam; the distributed optimizer sharding over 2 data-parallel ranks), one optimizer step taken, and
the estimate's parameter, gradient-buffer and optimizer-state bytes compared with the tensors that exist.
Activations are compared with the tensors autograd keeps for backward in one forward.
"""

import json
import os
import socket

import pytest
import torch

from helpers import run_mimo, start_world
from mimo.core.memory import fit
from mimo.core.config import (
    LaunchOptions, LayoutOptions, MemoryOptions, OptimizerOptions, PerformanceOptions, RunConfig, TrainingOptions,
)
from mimo.core.run.plan import prepare
from mimo.errors import UsageError

TINY_NEMOTRON = "nemotron-moe-vlm-tiny"


def config(provider, world=1, precision="fp32", distopt=False, settings=(), gpu_memory=None, **layout):
    return RunConfig(provider=provider, provider_settings=list(settings), launch=LaunchOptions(nproc_per_node=world),
                     training=TrainingOptions(micro_batch_size=2, num_microbatches=1, device="cpu",
                                              precision=precision),
                     optimizer=OptimizerOptions(use_distributed_optimizer=distopt),
                     layout=LayoutOptions(**layout), memory=MemoryOptions(gpu_memory=gpu_memory))


def _allocated(cfg: RunConfig, rank: int) -> dict:
    """On this rank: build the model and optimizer as a run does, take one step, and count megatron-core's
    buffers and states per module next to the estimate for this rank."""
    from mimo.core.parallel.model import held_modules
    from mimo.core.parallel.optim import build_optimizer
    from mimo.core.run.world import join

    plan = prepare(cfg, world_size=cfg.launch.nproc_per_node)
    dtype = torch.bfloat16 if cfg.training.precision == "bf16" else torch.float32
    world = join(plan, seed=1)
    model = world.build_model()
    optimizer = build_optimizer(cfg.optimizer, model=model, params_dtype=dtype)
    for param in model.parameters():
        param.main_grad.zero_()
    optimizer.step()  # Adam's moments exist from the first step on
    found = {}
    for name, module in held_modules(model):
        buffers = module.buffers + module.expert_parallel_buffers
        optimizers = [optimizer.module_infos[name].optimizer]
        optimizers = getattr(optimizers[0], "chained_optimizers", optimizers)
        state = sum(t.numel() * t.element_size() for o in optimizers for s in o.optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t) and t.numel() > 1)
        # bf16: the fp32 main weights (whole, or this rank's shard) the inner Adam steps; fp32: the parameters
        main = sum(p.numel() * 4 for o in optimizers for g in o.optimizer.param_groups for p in g["params"])
        found[name] = {"parameters": sum(p.numel() for p in module.parameters()),
                       # the parameters live in DDP's buffer when it has one (bf16, distributed optimizer)
                       "param_buffer": sum(b.param_data.numel() * b.param_data.element_size() for b in buffers
                                           if b.param_data is not None)
                       or sum(p.numel() * p.element_size() for p in module.parameters()),
                       "grad_buffer": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
                       "optimizer": state + (main if dtype == torch.bfloat16 else 0)}
    estimate = next(r for r in fit.estimate_plan(plan) if r.ranks[0] <= rank <= r.ranks[1])
    torch.distributed.destroy_process_group()
    return {"found": found, "estimate": {m.module: {"parameters": m.parameter_count, "param_bytes": m.parameters,
                                                    "gradients": m.gradients, "optimizer": m.optimizer}
                                         for m in estimate.modules}}


def _worker(rank: int, cfg: RunConfig, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cfg.launch.nproc_per_node), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    result = _allocated(cfg, rank)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


def allocated_in_world(cfg: RunConfig, tmp_path) -> list[dict]:
    """Per rank: megatron-core's buffers and the estimate, from a world of `nproc_per_node` gloo processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = cfg.launch.nproc_per_node
    start_world(_worker, (cfg, port, str(tmp_path / "r")), world)
    return [json.loads((tmp_path / f"r.{rank}").read_text()) for rank in range(world)]


@pytest.mark.parametrize("provider, world, precision, distopt, layout", [
    ("mock-vlm", 1, "fp32", False, {}),  # fp32: no main copy, moments only
    ("mock-vlm", 2, "bf16", True, {"llm_tp": 2, "encoder_tp": 2}),  # TP-split and replicated parameters
    (TINY_NEMOTRON, 2, "bf16", True, {}),  # dense and expert buffers, both sharded over DP 2
    (TINY_NEMOTRON, 2, "bf16", False, {"llm_ep": 2}),  # experts split over EP: a chained optimizer
    # Qwen3.5: the gated delta net and the vision tower split over TP; routed and shared experts over EP
    ("qwen3.5-vl-tiny", 2, "bf16", True, {"llm_tp": 2, "encoder_tp": 2}),
    ("qwen3.5-vl-moe-tiny", 2, "bf16", False, {"llm_ep": 2}),
])
def test_estimate_matches_megatron_buffers(provider, world, precision, distopt, layout, tmp_path):
    cfg = config(provider, world, precision, distopt, **layout)
    for rank, result in enumerate(allocated_in_world(cfg, tmp_path)):
        for module, found in result["found"].items():
            est = result["estimate"][module]
            where = f"rank {rank} {module}"
            assert est["parameters"] == found["parameters"], where  # exactly: the split by TP/EP is right
            # DDP pads its buffers (to 128 elements; the distributed optimizer to a multiple of DP x 128)
            assert 0 <= found["param_buffer"] - est["param_bytes"] <= 4 * 128 * world * 4, where
            assert 0 <= found["grad_buffer"] - est["gradients"] <= 4 * 128 * world * 4, where
            assert est["optimizer"] == pytest.approx(found["optimizer"], rel=0.02, abs=12 * 128 * world), where


def test_rank_kinds_of_a_heterogeneous_pipeline():
    """Encoders are the first stage of the multimodule 1F1B pipeline: they keep more micro-batches in flight."""
    cfg = RunConfig(provider="mock-vlm", launch=LaunchOptions(nproc_per_node=3),
                    training=TrainingOptions(micro_batch_size=2, num_microbatches=4, device="cpu"),
                    layout=LayoutOptions(encoder_ranks=1, llm_pp=2))
    ranks = fit.estimate_plan(prepare(cfg, world_size=3))
    assert [(r.kind, r.ranks) for r in ranks] == [("encoder ranks", (0, 0)), ("LLM stage 0", (1, 1)),
                                                  ("LLM stage 1", (2, 2))]
    in_flight = [m.in_flight for r in ranks for m in r.modules]
    assert in_flight == [3, 2, 1]
    first, last = ranks[1].modules[0], ranks[2].modules[0]
    assert first.layers == last.layers == 1
    assert first.parameter_count + last.parameter_count == prepare(cfg, world_size=3).shapes["language"].num_parameters


def test_recompute_and_micro_batch_shrink_activations():
    def activations(**options):
        cfg = config(TINY_NEMOTRON)
        cfg.training.micro_batch_size = options.get("mbs", 2)
        cfg.performance = PerformanceOptions(recompute=options.get("recompute", "none"))
        return fit.estimate_plan(prepare(cfg, world_size=1))[0].term("activations")

    none, full = activations(), activations(recompute="full")
    assert full < 0.6 * none and activations(mbs=4) == pytest.approx(2 * none, rel=0.05)


def test_saved_activations_on_cpu():
    """mock-vlm's estimate against the tensors autograd keeps in one bf16 forward (unique storages, weights left
    out): megatron-core's local layers on the CPU keep what they keep on a GPU, minus nothing."""
    from helpers import world_of_one
    from mimo.core.forward.batch_transfer import to_device
    from mimo.core.run.world import join
    from mimo.plugins import DataContext

    settings = ["hidden_size=128", "num_attention_heads=4", "num_layers=3", "seq_length=256", "vocab_size=64",
                "backend=local", "vision_hidden_size=64", "vision_layers=2", "image_size=64"]
    cfg = config("mock-vlm", precision="bf16", settings=settings)
    plan = prepare(cfg, world_size=1)
    with world_of_one():
        model = join(plan, seed=1).build_model()
        weights = {p.data_ptr() for p in model.parameters()}
        batch = next(iter(plan.hooks.data_provider(settings=plan.settings, ctx=DataContext(
            micro_batch_size=2, num_microbatches=1, num_lanes=1, seed=1))))
        inputs = to_device({k: v for k, v in batch.items() if k != "modality_inputs"}, torch.device("cpu"),
                           torch.float32)
        images = to_device(batch["modality_inputs"], torch.device("cpu"), torch.bfloat16)
        kept = {}

        def pack(t):
            if t.data_ptr() not in weights:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**inputs, modality_inputs=images)
    estimate = fit.estimate_plan(plan)[0].term("activations")
    assert estimate == pytest.approx(sum(kept.values()), rel=0.05)


def test_refusal_is_one_line_naming_memory():
    cfg = config(TINY_NEMOTRON, gpu_memory=1)
    with pytest.raises(UsageError) as err:
        fit.check(prepare(cfg, world_size=1))
    text = str(err.value)
    assert "\n" not in text and text.startswith("memory: all ranks 0-0 need about")
    assert "above the 1 GiB limit (--gpu-memory); largest term:" in text and "try " in text
    fit.check(prepare(config(TINY_NEMOTRON), world_size=1))  # a CPU run: no limit unless asked


def test_cpu_runs_are_not_limited_unless_asked(monkeypatch):
    monkeypatch.setattr(fit, "visible_gpu_gib", lambda: None)
    assert fit.gpu_limit_gib(config("mock-vlm")) is None
    auto = config("mock-vlm")
    auto.training.device = "auto"
    assert fit.gpu_limit_gib(auto) is None
    assert fit.gpu_limit_gib(auto, planning=True) == (80.0, "default")
    monkeypatch.setattr(fit, "visible_gpu_gib", lambda: 79.2)
    assert fit.gpu_limit_gib(auto) == (79.2, "the visible GPU")
    assert fit.gpu_limit_gib(config("mock-vlm", gpu_memory=40)) == (40, "--gpu-memory")


@pytest.mark.smoke
def test_plan_54l_one_rank_refused_32_ranks_fit():
    bad = run_mimo("plan", "--provider", "nemotron-moe-vlm-54l", "--gpu-memory", "80")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("error: memory: all ranks 0-0 need about")
    ok = run_mimo("plan", "--provider", "nemotron-moe-vlm-54l", "--gpu-memory", "80", "--nproc-per-node", "32",
                  "--encoder-ranks", "8", "--llm-ep", "8", "--use-distributed-optimizer", "--precision", "bf16",
                  "--micro-batch-size", "1", "--recompute", "full", "--json")
    assert ok.returncode == 0, ok.stderr
    memory = json.loads(ok.stdout)["memory"]
    assert memory["limit"] == 80 and [r["kind"] for r in memory["ranks"]] == ["encoder ranks", "LLM ranks"]
    for rank in memory["ranks"]:
        assert rank["fits"] and 0 < rank["total"] < 80
        assert set(rank) >= {"parameters", "gradients", "optimizer", "activations", "allowance", "total",
                             "headroom", "modules"}


def test_contract_kit_checks_module_memory(monkeypatch):
    """A provider whose module_memory disagrees with its model is caught by mimo.testing."""
    from mimo.plugins import ModuleMemory
    from mimo.providers.mock_vlm import memory as mock_memory
    from mimo.testing import ContractError, check_module_memory, load_subject
    from mimo.testing.memory_check import built_parameter_mismatch
    from mimo.testing.model_check import check_model_shape

    subject = load_subject("mock-vlm")
    shapes = check_model_shape(subject)
    assert check_module_memory(subject, shapes) is None
    real = mock_memory.module_memory(subject.settings)
    short = {**real, "language": ModuleMemory(real["language"].layers[1:], real["language"].tokens_per_sample,
                                              real["language"].first, real["language"].last)}
    monkeypatch.setattr(mock_memory, "module_memory", lambda settings: short)
    with pytest.raises(ContractError) as err:
        check_module_memory(subject, shapes)
    assert str(err.value).startswith("module_memory: 'language': its layers hold")
    built = {name: shape.num_parameters for name, shape in shapes.items()}
    assert built_parameter_mismatch(real, built) is None and "'language'" in built_parameter_mismatch(short, built)


def test_visible_gpu_memory_comes_from_nvidia_smi_for_this_process(tmp_path, monkeypatch):
    """nvidia-smi is asked about the first GPU CUDA_VISIBLE_DEVICES gives this process, once."""
    calls = tmp_path / "calls"
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\necho 81559\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    fit.visible_gpu_gib.cache_clear()
    try:
        assert fit.visible_gpu_gib() == pytest.approx(81559 / 1024)
        assert fit.visible_gpu_gib() == pytest.approx(81559 / 1024)
        assert calls.read_text().splitlines() == ["-i 3 --query-gpu=memory.total --format=csv,noheader,nounits"]
    finally:
        fit.visible_gpu_gib.cache_clear()
