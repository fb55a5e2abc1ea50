"""`--encoder-pass step` (core/forward/encoder_pass.py): the encoders run once per step on every micro-batch's inputs
and their backward once after the last micro-batch, and training is that of running them per micro-batch (losses,
gradient norms, every gradient), for mock-vlm's fixed tiles (some micro-batches without an image) and Nemotron's
dynamic-resolution RADIO; the image modes' `concat` equals collating everything at once; a layout or value it
cannot take is one clear error; auto chooses per device; the memory estimate counts a step's encoder activations;
the LLM's gradients are finished before the encoders' backward."""

from __future__ import annotations

import pytest
import torch

from helpers import read_metrics, run_mimo, world_of_one
from mimo.core.config import LayoutOptions, PerformanceOptions, RunConfig, TrainingOptions
from mimo.core.parallel.embedding_merge import placeholder_rows
from mimo.core.forward.batch_transfer import to_device
from mimo.core.forward.encoder_pass import StepEncoderPass
from mimo.core.run.plan import prepare
from mimo.core.run.world import join
from mimo.errors import UsageError

ENV = {"OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1"}
CPU = torch.device("cpu")

MOCK_SMALL = ["image_size=32", "patch_size=8", "vision_hidden_size=32", "vision_layers=1", "vision_heads=2",
              "hidden_size=32", "num_layers=1", "num_attention_heads=2", "seq_length=32", "vocab_size=64",
              "image_probability=0.5"]


# --------------------------------------------------------------------------------------------- end to end


def _train(tmp_path, name, provider, mode, *args):
    metrics = tmp_path / f"{name}-{mode}.jsonl"
    result = run_mimo("run", "--provider", provider, "--device", "cpu", "--log-interval", "1", "--seed", "5",
                      "--encoder-pass", mode, "--metrics-file", str(metrics), *args, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    banner = next(line for line in result.stdout.splitlines() if line.startswith("mimo run:"))
    assert ("(encoders once per step)" in banner) == (mode == "step"), banner
    return read_metrics(metrics)


@pytest.mark.parametrize("provider, args", [
    ("mock-vlm", ["--train-iters", "4", "--micro-batch-size", "2", "--num-microbatches", "3",
                  "--set", "hidden_size=64", "--set", "num_layers=2", "--set", "image_probability=0.5"]),
    ("nemotron-moe-vlm-tiny", ["--train-iters", "3", "--micro-batch-size", "1", "--num-microbatches", "4"]),
])
def test_step_pass_trains_like_micro_batch_pass(tmp_path, provider, args):
    """`mimo run --encoder-pass step` logs the same lm loss and grad norms, iteration by iteration, as micro-batch."""
    step = _train(tmp_path, provider, provider, "step", *args)
    micro = _train(tmp_path, provider, provider, "micro-batch", *args)
    assert [r["iteration"] for r in step] == [r["iteration"] for r in micro] == list(range(1, len(micro) + 1))
    assert len(micro) >= 3
    for ref, got in zip(micro, step):
        for key in ("lm_loss", "grad_norm", "grad_norm_images", "grad_norm_language"):
            assert got[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-9), (ref["iteration"], key)
    assert micro[-1]["grad_norm_images"] > 0  # the encoders did learn something in both runs


# --------------------------------------------------------------------------------------------- in process


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.main_grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def _inputs(batch):
    return to_device({k: v for k, v in batch.items() if k != "modality_inputs"}, CPU, torch.float32)


def _per_micro_batch(model, batches):
    """The reference: each micro-batch through the whole model (its encoders included) and its backward."""
    model.zero_grad_buffer()
    outputs = []
    for batch in batches:
        rows = placeholder_rows(batch["input_ids"], model.special_token_ids, CPU)
        modality = to_device(batch.get("modality_inputs") or {}, CPU, torch.float32)
        output, _ = model(**_inputs(batch), modality_inputs=modality or None, placeholder_rows=rows)
        output.sum().backward()
        outputs.append(output.detach())
    return outputs, _grads(model)


def _per_step(model, batches, plan):
    """The encoders once over every micro-batch, the LLM per micro-batch, then the encoders' backward once."""
    model.zero_grad_buffer()
    encoder_pass = StepEncoderPass(model, hooks=plan.hooks, settings=plan.settings, device=CPU,
                                   params_dtype=torch.float32)
    encoded = encoder_pass.forward(batches)
    assert [e.batch for e in encoded] == batches
    outputs = []
    for item in encoded:
        rows = placeholder_rows(item.batch["input_ids"], model.special_token_ids, CPU)
        output, _ = model(**_inputs(item.batch), modality_inputs=None, placeholder_rows=rows,
                          modality_embeddings=item.embeddings)
        output.sum().backward()
        outputs.append(output.detach())
    before = _grads(model)
    encoder_pass.backward()
    return outputs, _grads(model), before, encoded


def _has_images(batch) -> bool:
    return any(v is not None for v in (batch.get("modality_inputs") or {}).values())


@pytest.mark.parametrize("provider, settings, micro_batch, count", [
    ("mock-vlm", MOCK_SMALL, 1, 6),
    ("nemotron-moe-vlm-tiny", [], 1, 4),
])
def test_step_pass_gradients_equal_per_micro_batch(world, provider, settings, micro_batch, count):
    """StepEncoderPass forward + per-micro-batch LLM + one encoder backward leaves every gradient of running each
    micro-batch through the whole model."""
    plan = prepare(RunConfig(provider=provider, provider_settings=settings,
                             training=TrainingOptions(device="cpu", micro_batch_size=micro_batch)), world_size=1)
    run = join(plan)
    model = run.build_model()
    data = iter(plan.hooks.data_provider(settings=plan.settings, ctx=run.data_context()))
    batches = [next(data) for _ in range(count)]
    assert any(_has_images(b) for b in batches)
    if provider == "mock-vlm":
        assert not all(_has_images(b) for b in batches)  # some micro-batches have no image at all

    # one thread: the one pass runs every micro-batch's images in one GEMM, and with several threads the CPU's GEMMs
    # split their rows by batch size, so the encoder's outputs and every gradient after them differ in fp32 rounding
    # (gradients 2.5e-6 apart on two threads); the equality here is of the passes, not of GEMM tilings
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference, reference_grads = _per_micro_batch(model, batches)
        outputs, grads, before_encoder_backward, encoded = _per_step(model, batches, plan)
    finally:
        torch.set_num_threads(threads)

    encoder_names = [n for n in grads if n.startswith("modality_submodules.")]
    llm_names = [n for n in grads if n.startswith("language_model.")]
    assert encoder_names and llm_names and grads.keys() == reference_grads.keys()
    # the encoders' gradients come from the one backward at the end, not from the micro-batches' backward
    assert all(before_encoder_backward[n].abs().sum() == 0 for n in encoder_names)
    assert any(grads[n].abs().sum() > 0 for n in encoder_names)
    # each micro-batch got its own rows of the encoder output, none for a micro-batch without images
    for item, batch in zip(encoded, batches):
        for modality, token in model.special_token_ids.items():
            placeholders = int((batch["input_ids"] == token).sum())
            share = item.embeddings.get(modality)
            assert (share.shape[0] if share is not None else 0) == placeholders
    for ref, got in zip(reference, outputs):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads[name], reference_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------------------------- image modes


def _random_images(count, generator):
    return [torch.rand(3, int(torch.randint(9, 70, (1,), generator=generator)),
                       int(torch.randint(9, 70, (1,), generator=generator)), generator=generator)
            for _ in range(count)]


@pytest.mark.parametrize("mode_name", ["dynamic", "fixed"])
def test_image_mode_concat_equals_collating_everything(mode_name):
    """`DynamicResolution.concat` / `FixedTiles.concat` of per-micro-batch collations equals collating all images
    at once (x, imgs_sizes, THD cu_seqlens and max lengths)."""
    from mimo.plugins.data import DynamicResolution, FixedTiles

    mode = DynamicResolution(patch_size=8, min_patches=4, max_patches=32) if mode_name == "dynamic" else \
        FixedTiles(image_size=16, patch_size=8)
    generator = torch.Generator().manual_seed(0)
    processed = [mode.process(image) for image in _random_images(7, generator)]
    groups = [processed[:2], processed[2:3], processed[3:]]
    merged = mode.concat([mode.collate(g) for g in groups])
    whole = mode.collate(processed)
    assert merged.keys() == whole.keys()
    assert torch.equal(merged["x"], whole["x"])
    if mode_name == "fixed":
        assert merged["x"].shape[0] == 7
        return
    assert torch.equal(merged["imgs_sizes"], whole["imgs_sizes"]) and merged["imgs_sizes"].shape == (7, 2)
    got, want = merged["packed_seq_params"], whole["packed_seq_params"]
    assert torch.equal(got.cu_seqlens_q, want.cu_seqlens_q) and torch.equal(got.cu_seqlens_kv, want.cu_seqlens_kv)
    assert got.cu_seqlens_q.dtype == want.cu_seqlens_q.dtype == torch.int32
    assert (got.max_seqlen_q, got.max_seqlen_kv, got.qkv_format) == (want.max_seqlen_q, want.max_seqlen_kv, "thd")
    assert int(got.cu_seqlens_q[-1]) == merged["x"].shape[1]
    assert len({p.pixels.shape[0] for p in processed}) > 1  # the images do differ in size


# --------------------------------------------------------------------------------------------- choices and errors


def _plan(mode, *, world_size=1, layout=None, device="cpu", provider="mock-vlm"):
    return prepare(RunConfig(provider=provider, training=TrainingOptions(device=device),
                             layout=layout or LayoutOptions(), performance=PerformanceOptions(encoder_pass=mode)),
                   world_size=world_size)


def test_step_with_encoder_ranks_of_their_own_is_one_usage_error():
    """`--encoder-pass step` with heterogeneous encoder ranks is refused in `prepare` by one line naming the option;
    micro-batch and auto accept the layout."""
    with pytest.raises(UsageError) as err:
        _plan("step", world_size=3, layout=LayoutOptions(encoder_ranks=1))
    message = str(err.value)
    assert "--encoder-pass" in message and "--encoder-ranks" in message and "\n" not in message
    for mode in ("micro-batch", "auto"):
        assert not _plan(mode, world_size=3, layout=LayoutOptions(encoder_ranks=1)).step_encoders


def test_unknown_encoder_pass_value_is_refused():
    """`--encoder-pass sideways` stops the CLI with exit 2, naming the option and its choices."""
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--train-iters", "1",
                      "--encoder-pass", "sideways", env=ENV)
    text = result.stdout + result.stderr
    assert result.returncode == 2, text
    assert "--encoder-pass" in text and "sideways" in text and "Traceback" not in text
    assert "micro-batch" in text


def test_unknown_encoder_pass_in_a_config_file_is_refused(tmp_path):
    """`encoder_pass: sideways` in a --config file is a usage error naming the option, before training."""
    config = tmp_path / "run.yaml"
    config.write_text("provider: mock-vlm\nperformance:\n  encoder_pass: sideways\n")
    result = run_mimo("run", "--config", str(config), "--device", "cpu", "--train-iters", "1", env=ENV)
    text = result.stdout + result.stderr
    assert result.returncode == 2, text
    assert "performance.encoder_pass must be one of auto, step, micro-batch, got 'sideways'" in text, text
    assert "Traceback" not in text


def test_auto_is_micro_batch_on_cpu_and_step_is_step():
    """On a CPU run auto chooses once per micro-batch; step and micro-batch are what they say."""
    assert _plan("auto").step_encoders is False
    assert _plan("step").step_encoders is True
    assert _plan("micro-batch").step_encoders is False
    assert _plan("step", provider="nemotron-moe-vlm-tiny").step_encoders is True


def test_the_llms_stages_beside_colocated_encoders_run_them_once_per_step_and_refuse_micro_batch():
    """core/forward/encoders_beside_stages.py: the encoders leave the LLM's pipeline, on the CPU too; the colocated
    encoders at a TP of their own run per micro-batch (they read other samples than the LLM)."""
    beside = LayoutOptions(llm_pp=2)
    assert _plan("auto", world_size=2, layout=beside).step_encoders is True
    with pytest.raises(UsageError, match="^--encoder-pass micro-batch cannot run the encoders beside the LLM's "
                                         "pipeline stages"):
        _plan("micro-batch", world_size=2, layout=beside)
    with pytest.raises(UsageError, match="^--encoder-pass step: the colocated encoders run at a TP of their own"):
        _plan("step", world_size=2, layout=LayoutOptions(llm_tp=2))


def test_auto_is_step_on_a_gpu_where_it_can_run_and_a_provider_without_the_hook_cannot():
    """`step_encoders`: auto picks step for a GPU device with the hook, never without it; step without the
    provider's concat_encoder_inputs hook is one UsageError naming the hook."""
    import pluggy

    from mimo.core.forward.encoder_pass import step_encoders
    from mimo.plugins import defaults, hookspecs
    from mimo.plugins.manager import ProviderHooks

    plan = _plan("micro-batch")
    assert step_encoders("auto", hooks=plan.hooks, parallelism=plan.parallelism, device="cuda") is True
    assert step_encoders("auto", hooks=plan.hooks, parallelism=plan.parallelism, device="cpu") is False
    manager = pluggy.PluginManager("mimo")
    manager.add_hookspecs(hookspecs)
    manager.register(defaults, name="mimo.defaults")
    bare = ProviderHooks(manager, [])  # the loop's defaults only: no concat_encoder_inputs
    assert step_encoders("auto", hooks=bare, parallelism=plan.parallelism, device="cuda") is False
    with pytest.raises(UsageError, match="--encoder-pass step: the provider does not implement the "
                                         "concat_encoder_inputs hook"):
        step_encoders("step", hooks=bare, parallelism=plan.parallelism, device="cpu")


def test_memory_estimate_counts_a_steps_encoder_activations():
    """With step_encoders the encoder's activations term covers all micro-batches' samples; the LLM's is unchanged."""
    from mimo.core.memory.fit import estimate_plan

    def terms(step):
        plan = prepare(RunConfig(provider="nemotron-moe-vlm-tiny",
                                 training=TrainingOptions(device="cpu", micro_batch_size=1, num_microbatches=4),
                                 performance=PerformanceOptions(encoder_pass="step" if step else "micro-batch")),
                       world_size=1)
        assert plan.step_encoders is step and plan.num_microbatches == 4
        (rank,) = estimate_plan(plan)
        return {m.module: m for m in rank.modules}

    step, micro = terms(True), terms(False)
    assert step["images"].activations > micro["images"].activations > 0
    assert step["images"].activations == pytest.approx(4 * micro["images"].activations, rel=0.05)
    assert step["language"].activations == micro["language"].activations
    assert step["images"].parameters == micro["images"].parameters


def test_the_language_models_gradients_are_finished_before_the_encoders_backward(world, monkeypatch):
    """With the step pass the LLM's reduction and scaling are queued before the encoders' backward (GPU work while
    the host launches it), the encoders' own after it; without the pass the order is the held modules'."""
    from types import SimpleNamespace

    from mimo.core.run.step import TrainStep
    from mimo.core.telemetry.timers import StepTimers

    order = []
    model = SimpleNamespace(modality_submodules={"images": "vision"}, language_model="llm")
    step = TrainStep.__new__(TrainStep)
    step.model, step._data_counts, step._data_source, step._loss_source = model, lambda: None, True, True
    step._totals = torch.tensor([6.0, 3.0, 0.0], dtype=torch.float64)
    step.timers = StepTimers(False, modules=[], held=[], device=CPU)
    monkeypatch.setattr(step, "_finalize_modules", lambda modules, scale, force: order.extend(
        (name, round(float(scale), 6)) for name, _ in modules), raising=False)
    step.encoder_pass = SimpleNamespace(backward=lambda: order.append(("encoders-backward", None)))
    step._finalize_grads([model], None)
    assert order == [("language", 0.333333), ("encoders-backward", None), ("images", 0.333333)]
    order.clear()
    step.encoder_pass = None
    step._finalize_grads([model], None)
    assert order == [("images", 0.333333), ("language", 0.333333)]
