"""LoRA in one process (core/adapters/): the options and targets refused in one line; adapters on the layers named,
every base weight frozen without a gradient buffer, only adapters in the optimizer and changed by it; the base
untouched by training, bit for bit; merging gives the adapted model's logits (fp32); the count a run reports is the
model's; `mimo plan` names the adapters, their bound and the base, and says up front that shared-outer expert
adapters export only merged."""

from __future__ import annotations

import pytest
import torch

from helpers import train_steps, world_of_one
from mimo.core.adapters import linears
from mimo.core.adapters.apply import adapter_parameters, is_adapter_name, merge_adapters
from mimo.core.adapters.targets import resolve
from mimo.core.config import AdapterOptions, CheckpointOptions, OptimizerOptions, RunConfig, TrainingOptions
from mimo.core.config.adapters import parse_targets
from mimo.core.forward.batch_transfer import to_device
from mimo.core.parallel.optim import build_optimizer
from mimo.core.run.plan import prepare
from mimo.core.run.world import join
from mimo.errors import UsageError

MOCK = ["image_size=32", "patch_size=8", "vision_hidden_size=32", "vision_layers=1", "vision_heads=2",
        "hidden_size=32", "num_layers=1", "num_attention_heads=2", "seq_length=32", "vocab_size=64"]


def test_targets_parse_per_module():
    assert parse_targets("language:linear_qkv, linear_proj;images:all; projection:all") == {
        "language": ("linear_qkv", "linear_proj"), "images": ("all",), "projection": ("all",)}


@pytest.mark.parametrize("options, message", [
    (dict(lora_rank=-1), "--lora-rank must be 0"),
    (dict(lora_rank=4, lora_alpha=0.0), "--lora-alpha must be positive"),
    (dict(lora_rank=4, lora_dropout=1.0), "--lora-dropout must lie in [0, 1)"),
    (dict(lora_targets="language:all"), "--lora-targets needs --lora-rank"),
    (dict(lora_rank=4, lora_targets="language"), "write MODULE:NAME,NAME"),
    (dict(lora_rank=4, lora_targets="language:a;language:b"), "names module 'language' twice"),
])
def test_bad_options_are_one_line(options, message):
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")) as err:
        AdapterOptions(**options).validate()
    assert "\n" not in str(err.value)


def test_a_target_module_the_model_lacks_names_the_modules():
    with pytest.raises(UsageError, match="names module 'audio'; choose among language, images, projection"):
        resolve("audio:all", None, ["images"], "mock-vlm")
    with pytest.raises(UsageError, match="provider 'x' declares no default targets"):
        resolve(None, None, ["images"], "x")


def test_scale_defaults_to_two():
    assert AdapterOptions(lora_rank=8).scale == 2.0
    assert AdapterOptions(lora_rank=8, lora_alpha=4).scale == 0.5


def test_resuming_adapters_does_not_say_their_optimizer_starts_anew(tmp_path, monkeypatch, capsys):
    """A LoRA resume loads its --pretrained base before the adapters' checkpoint, which restores the optimizer,
    the schedule and the data: the base's line says they start anew only when nothing is resumed."""
    from mimo.core.checkpoint import checkpointer

    ckpt = object.__new__(checkpointer.Checkpointer)
    ckpt.options, ckpt.optimizer, ckpt.lora = CheckpointOptions(pretrained=str(tmp_path)), object(), True
    ckpt.load_hf = ckpt.load_foreign = None
    ckpt._check_compatible = ckpt._load_model = lambda *args: None
    ckpt._model_state, ckpt._dist_load = (lambda part: {}), (lambda state, directory: state)
    ckpt._refresh_main_params = lambda: None
    monkeypatch.setattr(checkpointer, "foreign_directory", lambda path: None)
    monkeypatch.setattr(checkpointer, "read_tracker", lambda root: 2)
    monkeypatch.setattr(checkpointer, "read_common", lambda d: {"contents": {}, "run": {"provider": "mock-vlm"}})
    monkeypatch.setattr(checkpointer.adapter_state, "check_saved", lambda *args: None)
    monkeypatch.setattr(checkpointer.dist, "get_rank", lambda: 0)
    ckpt._load_base()
    assert capsys.readouterr().out.rstrip().endswith("; optimizer, schedule and data start anew")
    ckpt._load_base(resuming=True)
    line = capsys.readouterr().out.rstrip()
    assert line.startswith(f"loaded weights from {tmp_path}") and "anew" not in line


@pytest.fixture(scope="module")
def world():
    with world_of_one():
        yield


def _build(provider, settings=(), **adapters):
    plan = prepare(RunConfig(provider=provider, provider_settings=list(settings),
                             training=TrainingOptions(device="cpu", micro_batch_size=2),
                             optimizer=OptimizerOptions(lr=0.05),
                             adapters=AdapterOptions(lora_rank=4, **adapters)), world_size=1)
    run = join(plan)
    model = run.build_model()
    batch = next(iter(plan.hooks.data_provider(settings=plan.settings, ctx=run.data_context())))
    return plan, model, batch


def _forward(model, batch, labels=True):
    inputs = to_device({k: v for k, v in batch.items() if k != "modality_inputs" and (labels or k != "labels")},
                       torch.device("cpu"), torch.float32)
    modality = to_device(batch["modality_inputs"], torch.device("cpu"), torch.float32)
    output, _ = model(**inputs, modality_inputs=modality or None)
    return output


def test_unknown_layer_name_lists_the_modules_layers(world):
    with pytest.raises(UsageError, match=r"--lora-targets language: no layer named 'linear_qkvv' there; its "
                                         r"layers: all, linear_fc1, linear_fc2, linear_proj, linear_qkv, output_layer"):
        _build("mock-vlm", MOCK, lora_targets="language:linear_qkvv")


def test_only_adapters_train_and_the_base_stays_bit_identical(world):
    plan, model, batch = _build("mock-vlm", MOCK)
    adapters = adapter_parameters(model)
    # the provider's targets: attention and MLP of both transformers (1 layer each) and the projection's 2 linears
    assert len(adapters) == 2 * (4 + 4 + 2)
    assert all(p.requires_grad for _, p in adapters)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter_name(n)}
    assert not any(p.requires_grad or hasattr(p, "main_grad") for n, p in model.named_parameters()
                   if not is_adapter_name(n))  # no gradient buffer: DDP saw them frozen
    optimizer = build_optimizer(plan.config.optimizer, model=model, params_dtype=torch.float32)
    in_optimizer = {id(p) for info in optimizer.module_infos.values() if info.optimizer
                    for group in info.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for _, p in adapters}
    before = {n: p.detach().clone() for n, p in adapters}
    losses = train_steps(model, optimizer, lambda: _forward(model, batch).mean(), 3)
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if not is_adapter_name(n))
    assert all(not torch.equal(p, before[n]) for n, p in adapters if n.endswith(".b"))  # B left zero


@pytest.mark.parametrize("provider, settings, layout", [
    ("mock-vlm", MOCK, "shared"),
    ("nemotron-moe-vlm-tiny", [], "shared"),
    ("nemotron-moe-vlm-tiny", [], "per-expert"),
    # mimo's grouped-GEMM SequentialMLP: the adapters' terms in its grouped forward (test_lora_grouped_experts.py)
    ("nemotron-moe-vlm-tiny", ["expert_gemm=grouped_mm"], "per-expert"),
    ("nemotron-moe-vlm-tiny", ["expert_gemm=grouped_mm"], "shared"),
    ("nemotron-moe-vlm-tiny", [], "shared-outer"),
    ("nemotron-moe-vlm-tiny", ["expert_gemm=grouped_mm"], "shared-outer"),
])
def test_merged_logits_equal_base_plus_adapters(world, provider, settings, layout):
    targets = "language:all;images:all;projection:all"
    plan, model, batch = _build(provider, settings, lora_targets=targets, lora_experts=layout)
    model.eval()
    with torch.no_grad():
        base = _forward(model, batch, labels=False)  # B zero: the adapters add nothing yet
        torch.manual_seed(0)
        for name, param in adapter_parameters(model):
            if name.endswith(".b"):
                param.normal_(0, 0.05)  # as after training: B away from zero
        base_and_adapters = _forward(model, batch, labels=False)
        assert merge_adapters(model) > 0
        assert not adapter_parameters(model) and not any(linears.is_adapted(m) for m in model.modules())
        merged = _forward(model, batch, labels=False)
    scale = base_and_adapters.abs().max().item()
    assert (base_and_adapters - base).abs().max().item() > 1e-2 * scale  # every adapter counts below
    # fp32: the merged weight rounds W + BA once where the adapted forward rounds Wx and BAx apart; through
    # Nemotron's Mamba, MoE and attention layers that order of summation moves a few logits by some 1e-6 of
    # their scale (mock-vlm's by less than 1e-6)
    assert (merged - base_and_adapters).abs().max().item() <= 4e-6 * scale
    assert (merged - base_and_adapters).abs().mean().item() <= 1e-7 * scale


@pytest.mark.parametrize("layout", ["shared", "shared-outer", "per-expert"])
def test_the_memory_plan_counts_frozen_weights_without_gradients_or_optimizer_state(world, layout):
    from mimo.core.memory import fit

    def terms(**adapters):
        plan = prepare(RunConfig(provider="nemotron-moe-vlm-tiny", training=TrainingOptions(precision="bf16"),
                                 adapters=AdapterOptions(**adapters)), world_size=1)
        return {m.module: m for rank in fit.estimate_plan(plan) for m in rank.modules}

    _, model, _ = _build("nemotron-moe-vlm-tiny", lora_experts=layout)
    built = {name: sum(p.numel() for n, p in adapter_parameters(model) if n.startswith(prefix))
             for name, prefix in (("language", "language_model."), ("images", "modality_submodules.images."))}
    full, lora = terms(), terms(lora_rank=4, lora_experts=layout)
    for name, module in lora.items():
        adapters = module.parameter_count - full[name].parameter_count
        assert built[name] <= adapters <= 3 * built[name], name  # an upper bound of the right size
        assert module.parameters == full[name].parameters + 2 * adapters  # bf16 weights, the base's kept
        assert module.gradients == 4 * adapters and module.optimizer == 12 * adapters  # adapters' only


@pytest.mark.parametrize("layout", ["shared", "shared-outer", "per-expert"])
def test_the_runs_adapter_count_is_the_models(world, layout):
    """What the run's first line and its checkpoints say train: every adapter parameter once, counted from the
    tensors a checkpoint holds (Mamba's in_proj B saved in parts, experts' shared halves saved by their owner)."""
    from mimo.core.run.lora_report import adapter_counts

    _, model, _ = _build("nemotron-moe-vlm-tiny", lora_experts=layout)
    counts = adapter_counts(model)
    built = {name: sum(p.numel() for n, p in adapter_parameters(model) if n.startswith(prefix))
             for name, prefix in (("language", "language_model."), ("images", "modality_submodules.images."))}
    assert counts == built and all(built.values())


def _plan(**adapters):
    return prepare(RunConfig(provider="nemotron-moe-vlm-tiny", adapters=AdapterOptions(lora_rank=4, **adapters)),
                   world_size=1)


def test_the_plan_names_the_adapters_their_bound_and_the_base():
    from mimo.cli.plan import _adapter_line, describe

    adapters = describe(_plan())["adapters"]
    assert adapters["rank"] == 4 and adapters["alpha"] == 8 and adapters["experts"] == "shared"
    assert adapters["targets"]["language"] == ["linear_qkv", "linear_proj", "in_proj", "out_proj", "experts",
                                               "shared_experts"]
    # the memory plan's bound: the built model has 12,320 (tests/unit/test_lora.py checks the bound's size)
    assert 12_320 <= adapters["trainable_at_most"] <= 3 * 12_320
    assert 0 < adapters["share_at_most"] < 0.2 and adapters["peft_export"] and adapters["note"] is None
    line = _adapter_line(adapters)
    assert line.startswith("LoRA adapters: rank 4, alpha 8, experts shared on language: linear_qkv, linear_proj")
    assert f"at most {adapters['trainable_at_most']:,} trainable parameters (" in line
    assert line.endswith("base the provider's initialization (--seed 1234), frozen")
    assert describe(prepare(RunConfig(provider="nemotron-moe-vlm-tiny"), world_size=1))["adapters"] is None


def test_shared_outer_expert_adapters_say_at_start_up_that_they_export_only_merged():
    from mimo.cli.plan import describe
    from mimo.core.run.preflight import peft_note

    note = peft_note(_plan(lora_experts="shared-outer"))
    assert note.startswith("note: --lora-experts shared-outer: the routed experts' adapters have no PEFT form")
    assert "mimo ckpt merge-lora" in note and "\n" not in note
    assert describe(_plan(lora_experts="shared-outer"))["adapters"]["note"] == note
    # no routed experts adapted, or another layout: nothing to say
    assert peft_note(_plan(lora_experts="shared-outer", lora_targets="language:linear_qkv")) is None
    assert peft_note(_plan(lora_experts="per-expert")) is None


def test_a_shared_outer_run_that_saves_says_so_before_it_trains(tmp_path, capsys):
    from mimo.core.run import preflight

    config = RunConfig(provider="nemotron-moe-vlm-tiny", training=TrainingOptions(device="cpu"),
                       adapters=AdapterOptions(lora_rank=4, lora_experts="shared-outer"),
                       checkpoint=CheckpointOptions(save=tmp_path / "ck"))
    with preflight.for_run(config):
        pass
    assert "note: --lora-experts shared-outer: the routed experts' adapters have no PEFT form" in \
        capsys.readouterr().out
