"""What the GPU speed options do, checked where a CPU can check them: the options' validation, megatron-core's
configs for the transformer-engine additions (fused cross-entropy, shared-expert overlap, partial CUDA graphs) and
their switches, Nemotron's refusals, RADIO's rounded max_seqlen, the compile caches' places, and the Triton
autotune tables (pinned, recorded, merged) on real Triton autotuners. The kernels themselves run on the GPU
(scripts/gpu/slice.sh)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mimo.core.config import CompileOptions, MemoryOptions, PerformanceOptions, RunConfig, TrainingOptions
from mimo.core.run import compilation, kernel_tuning
from mimo.errors import UsageError
from mimo.plugins import BuildContext, ModuleParallelism
from mimo.providers.nemotron import TINY, NemotronVLMSettings
from mimo.providers.nemotron import model as nemotron_model

PARALLELISM = {"images": ModuleParallelism(0, 1), "language": ModuleParallelism(0, 1)}


@pytest.mark.parametrize("config, message", [
    (dict(performance=PerformanceOptions(cuda_graph_modules="mamba")), "--cuda-graph-modules needs --cuda-graphs"),
    (dict(performance=PerformanceOptions(cuda_graphs=True, cuda_graph_modules="mamba,ffn"),
          training=TrainingOptions(precision="bf16")),
     "--cuda-graph-modules: unknown name ffn; choose among attn, mlp, moe, moe_router, moe_preprocess, mamba"),
    (dict(memory=MemoryOptions(image_patches="most")), "--image-patches must be max, mean or a positive number"),
    (dict(compile=CompileOptions(kernel_configs="/nonexistent.json")), "--kernel-configs /nonexistent.json: no such"),
])
def test_bad_speed_options_are_one_line(config, message):
    with pytest.raises(UsageError) as err:
        RunConfig(provider="mock-vlm", **config).validate()
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def _te_fields(settings, ctx) -> dict:
    # transformer-engine's fused permutation and router are checked for at config time: absent on a CPU
    return {**nemotron_model._moe_config(settings, "te"), **nemotron_model._fused_kernels("te"),
            **nemotron_model._fused_loss(settings, "te"), **nemotron_model._cuda_graph_fields(settings, ctx, "te"),
            "moe_permute_fusion": False, "moe_router_fusion": False}


def test_nemotron_te_additions_make_a_valid_megatron_config(monkeypatch):
    settings = NemotronVLMSettings(**TINY)
    ctx = BuildContext(params_dtype=torch.bfloat16, parallelism=PARALLELISM, pg_collections={}, cuda_graphs=True)
    config = ctx.transformer_config("language", num_layers=2, hidden_size=64, num_attention_heads=4,
                                    **_te_fields(settings, ctx))
    assert (config.cross_entropy_loss_fusion, config.cross_entropy_fusion_impl) == (True, "te")
    assert config.moe_shared_expert_overlap and config.cuda_graph_impl == "transformer_engine"
    # the MoE layers' routers too: the routed experts (grouped GEMMs on device counts) stay eager
    assert [m.name for m in config.cuda_graph_modules] == ["mamba", "attn", "moe_router"]
    fp8 = dataclasses.replace(ctx, fp8="tensorwise")
    # with FP8 the routing map is padded in place, which transformer-engine's fused router must not have saved
    fp8_moe = nemotron_model._moe_config(settings, "te", fp8=True)
    assert fp8_moe["moe_router_padding_for_fp8"] and not fp8_moe["moe_router_fusion"]
    assert nemotron_model._moe_config(settings, "te")["moe_router_fusion"]
    assert nemotron_model._cuda_graph_fields(settings, fp8, "te") == {"cuda_graph_modules": ["mamba"]}
    # not where a router waits for the host or megatron-core refuses the scope beside recompute, nor when asked
    off = ({"settings": dataclasses.replace(settings, moe_router_graphs=False)},
           {"settings": dataclasses.replace(settings, expert_gemm="megatron")},
           {"ctx": dataclasses.replace(ctx, recompute={"language": "selective"})},
           {"ctx": dataclasses.replace(ctx, parallelism={**PARALLELISM, "language": ModuleParallelism(0, 2, tp=2)})},
           {"ctx": dataclasses.replace(ctx, parallelism={**PARALLELISM,
                                                         "language": ModuleParallelism(0, 2, ep=2, expt_tp=2)})})
    for case in off:
        fields = nemotron_model._cuda_graph_fields(case.get("settings", settings), case.get("ctx", ctx), "te")
        assert fields == {"cuda_graph_modules": ["mamba", "attn"]}, case
    # under expert parallelism too: the dispatcher's wait for the token counts is outside the router's graph
    ep2 = dataclasses.replace(ctx, parallelism={**PARALLELISM, "language": ModuleParallelism(0, 2, ep=2)})
    assert nemotron_model._cuda_graph_fields(settings, ep2, "te") == {"cuda_graph_modules": ["mamba", "attn",
                                                                                          "moe_router"]}
    chosen = dataclasses.replace(ctx, cuda_graph_modules=("attn",))  # --cuda-graph-modules over the provider
    config = chosen.transformer_config("language", num_layers=2, hidden_size=64, num_attention_heads=4,
                                       **_te_fields(settings, ctx))
    assert [m.name for m in config.cuda_graph_modules] == ["attn"]
    # each addition has its switch, and MIMO_TE_EXTRAS=0 turns them all off
    off = dataclasses.replace(settings, fused_cross_entropy=False, shared_expert_overlap=False)
    assert not nemotron_model._fused_loss(off, "te")
    assert not nemotron_model._moe_config(off, "te")["moe_shared_expert_overlap"]
    monkeypatch.setenv("MIMO_TE_EXTRAS", "0")
    assert not nemotron_model._fused_loss(settings, "te")
    assert not nemotron_model._moe_config(settings, "te")["moe_shared_expert_overlap"]
    assert not nemotron_model._fused_loss(settings, "local")


def test_what_a_providers_build_refuses_the_plan_refuses_before_any_process_starts():
    """Sequence parallelism on the local backend: the provider's build refuses it, and `mimo plan` (and the
    launcher, which makes the same plan) says so in one line instead of every worker after the processes started."""
    from mimo.core.config import LaunchOptions, LayoutOptions
    from mimo.core.run.plan import prepare

    config = RunConfig(provider="nemotron-moe-vlm-tiny", launch=LaunchOptions(nproc_per_node=3),
                       training=TrainingOptions(micro_batch_size=1), layout=LayoutOptions(encoder_ranks=1, llm_tp=2),
                       performance=PerformanceOptions(sequence_parallel=True))
    with pytest.raises(UsageError) as err:
        prepare(config, world_size=3)
    message = str(err.value)
    assert message.startswith("provider 'nemotron-moe-vlm-tiny': --sequence-parallel needs backend te")
    assert "\n" not in message
    plain = dataclasses.replace(config, layout=LayoutOptions(encoder_ranks=1), performance=PerformanceOptions())
    assert prepare(plain, world_size=3).parallelism["language"].dp == 2


@pytest.mark.parametrize("ctx_fields, backend, message", [
    (dict(cuda_graphs=True), "local", "--cuda-graphs needs backend te"),
    (dict(cuda_graphs=True, llm_input_packed=True), "te", "--cuda-graphs: packed --data gives the LLM sequences"),
])
def test_nemotron_refuses_graphs_it_cannot_replay(ctx_fields, backend, message):
    ctx = BuildContext(params_dtype=torch.bfloat16, parallelism=PARALLELISM, pg_collections={}, **ctx_fields)
    with pytest.raises(ValueError, match=message):
        nemotron_model._cuda_graph_fields(NemotronVLMSettings(**TINY), ctx, backend)


def test_radio_max_seqlen_is_a_rounded_bound():
    params = nemotron_model._packed_params([100, 300, 40], None, "cpu", class_tokens=8)
    assert params.cu_seqlens_q.tolist() == [0, 100, 400, 440]
    assert params.max_seqlen_q == params.max_seqlen_kv == 512 - 8  # with RADIO's 8 class tokens: 512
    assert nemotron_model._packed_params([256], None, "cpu").max_seqlen_q == 256
    assert nemotron_model._packed_params([100, 300, 40], params, "cpu").max_seqlen_q == 512  # the data's, rounded
    with pytest.raises(ValueError, match="does not match the images' patch counts"):
        nemotron_model._packed_params([100, 301, 40], params, "cpu")


def test_compile_caches_live_under_compile_cache(tmp_path, monkeypatch):
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_AUTOTUNING", "MIMO_COMPILE_CACHE"):
        monkeypatch.delenv(name, raising=False)
    import os

    import torch._dynamo

    # torch's own patch puts the flag back (pytest's monkeypatch would delete it from torch's config module on undo,
    # which hides it: every later torch.compile call in the process then fails)
    with torch._dynamo.config.patch(disable=torch._dynamo.config.disable):
        compilation.configure(CompileOptions(torch_compile="on"), torch.device("cpu"))
        assert not torch._dynamo.config.disable and "TRITON_CACHE_DIR" not in os.environ
        monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
        compilation.configure(CompileOptions(), torch.device("cuda"))  # a set variable wins over the default
        assert torch._dynamo.config.disable and os.environ["TRITON_CACHE_DIR"] == "/elsewhere"
        assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
        compilation.configure(CompileOptions(compile_cache=tmp_path), torch.device("cuda"))  # the option wins over it
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("MIMO_COMPILE_CACHE", str(tmp_path / "shared"))
    assert compilation.cache_dir(CompileOptions()) == tmp_path / "shared"


def _autotuned():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.autotune(configs=[triton.Config({"BLOCK": 32}, num_warps=2), triton.Config({"BLOCK": 64}, num_warps=4)],
                     key=["n"])
    @triton.jit
    def scale(x, n, BLOCK: tl.constexpr):
        tl.store(x + tl.arange(0, BLOCK), tl.load(x + tl.arange(0, BLOCK)) * n)

    return scale


def test_kernel_choices_are_pinned_recorded_and_merged(tmp_path):
    tuners = {"kernels.scale": _autotuned()}
    chosen = tuners["kernels.scale"].configs[1]
    table = {"gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0", "triton": "3.6.0", "kernels": {
        "kernels.scale": [{"key": [8192, "torch.bfloat16"], "config": kernel_tuning.config_dict(chosen)},
                          {"key": [64, "torch.bfloat16"], "config": {"kwargs": {"BLOCK": 128}, "num_warps": 8}}]}}
    pinned, notes = kernel_tuning.pin([json.loads(json.dumps(table))], "NVIDIA H100 80GB HBM3", "9.0", tuners)
    assert pinned == 1 and tuners["kernels.scale"].cache[(8192, "torch.bfloat16")] is chosen
    assert notes == ["scale: a recorded config is not among this version's"]  # another version's list: autotunes
    recorded = kernel_tuning.record("NVIDIA H100 80GB HBM3", "9.0", tuners)
    assert recorded["kernels"]["kernels.scale"] == [table["kernels"]["kernels.scale"][0]]
    path = tmp_path / "cache" / "kernel_configs.json"
    kernel_tuning.write_table(path, dict(recorded, kernels={"kernels.scale": [
        {"key": [16, "torch.float32"], "config": kernel_tuning.config_dict(chosen)}]}))
    kernel_tuning.write_table(path, recorded)  # merged key by key with what the file held
    keys = [row["key"] for row in kernel_tuning.read_table(path)["kernels"]["kernels.scale"]]
    assert keys == [[16, "torch.float32"], [8192, "torch.bfloat16"]]
    # another GPU model of the same compute capability: used; of another: left out, with a note
    tuners["kernels.scale"].cache.clear()
    assert kernel_tuning.pin([dict(table, gpu="NVIDIA H100 PCIe")], "NVIDIA H100 80GB HBM3", "9.0", tuners)[0] == 1
    assert kernel_tuning.pin([dict(table, gpu="NVIDIA A100", capability="8.0")], "NVIDIA H100 80GB HBM3", "9.0",
                             tuners) == (0, ["a table recorded on NVIDIA A100 (compute capability 8.0) does not "
                                             "apply to NVIDIA H100 80GB HBM3 (9.0)"])


def test_compile_report_says_what_compiled():
    from triton.runtime.autotuner import Autotuner

    original = Autotuner.run
    report = kernel_tuning.CompileReport().start()
    assert Autotuner.run is not original
    report.tuned += [("_chunk_scan_fwd_kernel", 3.5, 11), ("_bmm_chunk_fwd_kernel", 0.4, 0)]
    report.compiled.append(("_layer_norm_fwd_1pass_kernel", 1.2))
    report.stop()
    assert Autotuner.run is original
    assert report.line(pinned=17, torch_compile=False) == (
        "Triton: 2 kernels autotuned in 3.9 s (11 configs timed), 1 compiled or loaded in 1.2 s, 17 choices pinned; "
        "slowest _chunk_scan_fwd_kernel 3.5 s, _layer_norm_fwd_1pass_kernel 1.2 s; torch.compile off")
