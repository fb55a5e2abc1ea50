"""The performance options (--recompute, --sequence-parallel, --overlap-*, --fp8, --cuda-graphs): validated before
any worker starts, applied to megatron-core's configs, and training the same model (what needs transformer-engine
or a GPU is checked on the device: docs/verification.md)."""

import pytest
import torch

from helpers import read_metrics, run_mimo
from mimo.core.config import OptimizerOptions, PerformanceOptions, RunConfig, TrainingOptions
from mimo.errors import UsageError
from mimo.plugins import BuildContext, ModuleParallelism


@pytest.mark.parametrize("options, message", [
    ({"recompute": "sometimes"}, "--recompute: unknown mode 'sometimes'; choose among none, selective, full"),
    ({"recompute": "language=full,=none"}, "--recompute 'language=full,=none': write MODE or MODULE=MODE,MODULE=MODE"),
    ({"overlap_param_gather": True}, "--overlap-param-gather needs --use-distributed-optimizer and "
                                     "--overlap-grad-reduce"),
    ({"fp8": "tensorwise"}, "--fp8 tensorwise needs --precision bf16"),
    ({"cuda_graphs": True}, "--cuda-graphs needs --precision bf16"),
])
def test_bad_options_are_one_line(options, message):
    config = RunConfig(provider="mock-vlm", performance=PerformanceOptions(**options))
    with pytest.raises(UsageError) as err:
        config.validate()
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_recompute_per_module():
    options = PerformanceOptions(recompute="language=full, images=selective")
    assert options.recompute_for("language") == "full" and options.recompute_for("images") == "selective"
    assert PerformanceOptions(recompute="selective").recompute_for("anything") == "selective"
    assert PerformanceOptions(recompute="language=full").recompute_for("images") == "none"
    config = RunConfig(provider="mock-vlm", performance=PerformanceOptions(recompute="llm=full"),
                       optimizer=OptimizerOptions(), training=TrainingOptions())
    from mimo.core.run.plan import prepare

    with pytest.raises(UsageError, match="--recompute names module 'llm', which provider 'mock-vlm' does not have: "
                                         "use images, language"):
        prepare(config, world_size=1)


def _config(ctx: BuildContext, module: str, **shape):
    return ctx.transformer_config(module, num_layers=2, hidden_size=64, num_attention_heads=4, **shape)


def test_options_reach_each_modules_transformer_config():
    parallelism = {"images": ModuleParallelism(0, 2, tp=2), "language": ModuleParallelism(0, 2, tp=2)}
    ctx = BuildContext(params_dtype=torch.bfloat16, parallelism=parallelism, pg_collections={},
                       recompute={"images": "selective", "language": "full"}, sequence_parallel=True)
    vision, language = _config(ctx, "images"), _config(ctx, "language")
    assert (vision.recompute_granularity, language.recompute_granularity) == ("selective", "full")
    assert "core_attn" in vision.recompute_modules
    assert (language.recompute_method, language.recompute_num_layers) == ("uniform", 1)
    assert language.sequence_parallel and not vision.sequence_parallel  # sequence parallelism is the LLM's
    plain = BuildContext(params_dtype=torch.float32, parallelism=parallelism, pg_collections={})
    assert _config(plain, "language").recompute_granularity is None
    with pytest.raises(TypeError, match="sequence_parallel are set by the loop"):
        _config(plain, "language", sequence_parallel=True)


@pytest.mark.parametrize("args, message", [
    (["--cuda-graphs", "--precision", "bf16"], "error: --cuda-graphs needs a GPU; this run is on the CPU"),
    (["--provider", "nemotron-moe-vlm-tiny", "--nproc-per-node", "2", "--llm-tp", "2", "--encoder-tp", "2"],
     "error: --llm-tp 2 with a mixture-of-experts LLM needs --sequence-parallel"),
    (["--set", "backend=te"], "error: provider 'mock-vlm': backend 'te' needs transformer-engine"),
    (["--set", "backend=local", "--nproc-per-node", "2", "--llm-tp", "2", "--encoder-tp", "2", "--sequence-parallel"],
     "error: --sequence-parallel needs transformer-engine's norms, which need a GPU: drop it on the CPU"),
])
def test_runs_that_cannot_work_here_stop_with_one_line(args, message):
    if importlib_has("transformer_engine") and "backend=te" in args:
        pytest.skip("transformer-engine is installed here")
    provider = [] if "--provider" in args else ["--provider", "mock-vlm"]
    result = run_mimo("run", *provider, *args, "--train-iters", "1", "--device", "cpu")
    assert result.returncode != 0
    assert message in result.stderr + result.stdout
    assert "Traceback" not in result.stderr + result.stdout


def test_what_a_cpu_run_cannot_do_is_refused_by_the_plan():
    # mimo plan accepted these, and mimo run's workers stopped after start-up (expert TP: with a traceback)
    from mimo.core.config import LaunchOptions, LayoutOptions
    from mimo.core.run.plan import prepare

    cpu = TrainingOptions(device="cpu")
    for options, message in (({"performance": PerformanceOptions(sequence_parallel=True)},
                               "--sequence-parallel needs transformer-engine's norms, which need a GPU"),
                              ({"layout": LayoutOptions(llm_expt_tp=2)},
                               "--llm-expt-tp 2 does not run on the CPU: split the experts with --llm-ep instead")):
        config = RunConfig(provider="nemotron-moe-vlm-tiny", training=cpu, launch=LaunchOptions(nproc_per_node=2),
                           **options)
        with pytest.raises(UsageError) as refused:
            prepare(config, world_size=2)
        assert str(refused.value).startswith(message)


def importlib_has(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _losses(tmp_path, name, *args, iterations=3):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_mimo("run", "--train-iters", str(iterations), "--log-interval", "1", "--device", "cpu",
                      "--metrics-file", str(metrics), *args)
    assert result.returncode == 0, result.stderr[-2000:]
    return [r["lm_loss"] for r in read_metrics(metrics)]


def test_recomputation_trains_the_same_model(tmp_path):
    """Recomputing in backward changes memory, never the numbers (fp32, CPU)."""
    plain = _losses(tmp_path, "none", "--provider", "nemotron-moe-vlm-tiny")
    assert _losses(tmp_path, "mixed", "--provider", "nemotron-moe-vlm-tiny",
                   "--recompute", "language=full,images=selective") == plain


def test_overlapped_communication_trains_the_same_model(tmp_path):
    """Two data-parallel ranks: reducing gradients and gathering parameters in buckets during backward and forward
    gives the losses of the unoverlapped run, and its checkpoint holds the updated weights (the parameter gather
    of the last update would otherwise wait for a next forward that never comes)."""
    import json

    common = ["--provider", "mock-vlm", "--nproc-per-node", "2", "--num-microbatches", "2",
              "--use-distributed-optimizer"]
    plain = _losses(tmp_path, "plain", *common, "--save", str(tmp_path / "plain"), iterations=2)
    overlapped = _losses(tmp_path, "overlap", *common, "--overlap-grad-reduce", "--overlap-param-gather",
                         "--save", str(tmp_path / "overlap"), iterations=2)
    assert overlapped == plain
    evaluated = []
    for name in ("plain", "overlap"):
        result = run_mimo("eval", "--provider", "mock-vlm", "--device", "cpu", "--load", str(tmp_path / name),
                          "--eval-iters", "1", "--json", str(tmp_path / f"{name}.json"))
        assert result.returncode == 0, result.stderr[-2000:]
        evaluated.append(json.loads((tmp_path / f"{name}.json").read_text())["lm_loss"])
    assert evaluated[0] == evaluated[1]
