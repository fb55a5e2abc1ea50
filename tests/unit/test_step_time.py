"""The layout advisor (core/step_time): its calibration is what the measured runs give, its estimates order every
measured pair of layouts as the measurements do (or pick one within 10% of the faster), the iteration model's
arithmetic, and `mimo plan --suggest` ranking by it."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys

import pytest
from typer.testing import CliRunner

from helpers import REPO
from mimo.core.step_time import calibration
from mimo.core.step_time.model import ModuleWork, StepInputs, estimate
from mimo.plugins import LANGUAGE, ModuleParallelism


def fit_script():
    spec = importlib.util.spec_from_file_location("fit_step_time", REPO / "scripts" / "fit_step_time.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["fit_step_time"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fitted():
    script = fit_script()
    return script, *script.fit(calibration.read())


def test_the_calibration_is_what_the_records_give(fitted):
    """Every fitted number in calibration.json is the fit of its records (scripts/fit_step_time.py), not typed in."""
    _, values, _ = fitted
    shipped = calibration.read()["fitted"]
    assert set(values) == set(shipped)
    for name, entry in values.items():
        assert entry["value"] == pytest.approx(shipped[name]["value"], rel=1e-6), name
        assert entry["from"] and entry["how"], name  # where it came from
    cal = calibration.load()
    assert 0.2 < cal.efficiency["encoder"] < 0.7 and 0.2 < cal.efficiency["language"] < 0.7


def test_first_choice_on_every_measured_pair_is_the_faster_or_within_10_percent(fitted):
    script, _, runs = fitted
    lines = []
    for a, b in script.PAIRS:
        measured = {r: runs[r].tokens_per_s_per_gpu() for r in (a, b)}
        estimated = {r: runs[r].estimate.tokens_per_s_per_gpu(runs[r].tokens_per_sample) * runs[r].speed
                     for r in (a, b)}
        chosen = max(estimated, key=estimated.get)
        lines.append(f"{a} vs {b}: measured {measured}, estimated {estimated}")
        assert measured[chosen] >= 0.9 * max(measured.values()), lines[-1]
    # the fitted runs are reproduced, the splits (overlapped in the model) are not slower than measured
    for id_ in script.FITTED_FROM:
        assert runs[id_].estimate.seconds == pytest.approx(runs[id_].measured_s * runs[id_].speed, rel=0.02), id_
    for id_ in ("slice-split-4096", "slice-split-ep3"):
        assert runs[id_].estimate.seconds < runs[id_].measured_s


# --- the model's arithmetic, on a made-up calibration: 1 TFLOP/s at full efficiency, 1 GB/s, no overheads

CAL = calibration.Calibration(reference_gpu="test", peak_flops=1e12, efficiency={"encoder": 1.0, "language": 1.0},
                              collective_bytes_per_s=1e9, all_to_all_bytes_per_s=1e9, optimizer_s_per_parameter=0.0,
                              encoder_pass_overhead_s=0.0, split_stage_overhead_s=0.0, bridge_s=0.0)


def inputs(parallelism, encoder_flops=1e12, language_flops=2e12, experts=0.0, routed=0.0, microbatches=4,
           trainable=False):
    modules = {"images": ModuleWork(encoder_flops, 0.0, 0.0, 100, 64, 2, trainable=trainable),
               LANGUAGE: ModuleWork(language_flops, 1e9, experts, 1000, 128, 4, trainable=trainable,
                                    routed_copies=routed)}
    return StepInputs(modules, parallelism, micro_batch_size=1, num_microbatches=microbatches,
                      recompute={}, step_encoders=True)


def test_colocated_is_encoder_plus_llm_on_every_rank():
    par = ModuleParallelism(0, 2)
    est = estimate(inputs({"images": par, LANGUAGE: par}), CAL)
    # 4 micro-batches x 2 lanes = 8 samples, 4 a rank, 3 forwards' FLOPs each
    assert est.seconds == pytest.approx(4 * 3 * (1 + 2))
    assert est.slowest.terms == pytest.approx({"encoder compute": 12.0, "LLM compute": 24.0})


def test_a_split_takes_its_slower_stage_plus_fill_and_drain():
    split = {"images": ModuleParallelism(0, 1), LANGUAGE: ModuleParallelism(1, 1)}
    est = estimate(inputs(split, encoder_flops=1e12, language_flops=2e12), CAL)
    encoder, language = 4 * 3 * 1.0, 4 * 3 * 2.0  # each stage's busy seconds for its 4 micro-batches
    assert [s.busy for s in est.stages] == pytest.approx([encoder, language])
    assert est.slowest.name == "LLM ranks"
    assert est.seconds == pytest.approx(language + encoder / 4)  # the encoder's one micro-batch fills the pipe
    balanced = estimate(inputs(split, encoder_flops=2e12, language_flops=2e12), CAL)
    assert balanced.seconds == pytest.approx(24 + 6)  # not the sum, 48
    bridged = estimate(inputs(split), dataclasses.replace(CAL, bridge_s=0.5, split_stage_overhead_s=1.0))
    assert bridged.seconds == pytest.approx(language + 4 * 1.0 + (encoder + 0) / 4 + 4 * 0.5)


def test_expert_parallelism_sends_its_routed_tokens_and_reduces_only_dense_gradients():
    ep = ModuleParallelism(0, 4, ep=4)
    dp = ModuleParallelism(0, 4)
    with_ep = estimate(inputs({"images": dp, LANGUAGE: ep}, experts=3e9, routed=6.0, trainable=True), CAL)
    without = estimate(inputs({"images": dp, LANGUAGE: dp}, experts=3e9, routed=6.0, trainable=True), CAL)
    # 4 micro-batches of 1000 tokens, 6 copies of 128 values in bf16, 4 all-to-alls, 3 of 4 to other ranks
    assert with_ep.slowest.terms["EP all-to-all"] == pytest.approx(4 * 1000 * 6 * 128 * 2 * 4 * 0.75 / 1e9)
    assert "EP all-to-all" not in without.slowest.terms
    ring = 2 * 3 / 4
    assert without.reduce_s == pytest.approx(4 * (1e9 + 3e9) * ring / 1e9)
    assert with_ep.reduce_s == pytest.approx(4 * 1e9 * ring / 1e9)  # each expert lives on one rank: EP 4 of 4


def test_full_recomputation_costs_a_forward():
    par = ModuleParallelism(0, 1)
    base = inputs({"images": par, LANGUAGE: par})
    full = estimate(dataclasses.replace(base, recompute={LANGUAGE: "full"}), CAL)
    assert full.seconds - estimate(base, CAL).seconds == pytest.approx(4 * 2.0)


# --- mimo plan --suggest


def suggest(*args):
    from mimo.cli.main import app

    result = CliRunner().invoke(app, ["plan", "--provider", "mock-vlm", "--suggest", "--gpus", "4", "--precision",
                                      "bf16", "--device", "cuda", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_suggest_ranks_the_layouts_that_fit_by_estimated_tokens_per_gpu():
    from mimo.core.step_time.advisor import milliseconds

    report = json.loads(suggest("--json"))
    layouts = report["layouts"]
    speeds = [row["tokens_per_s_per_gpu"] for row in layouts]
    assert len(layouts) > 2 and speeds == sorted(speeds, reverse=True)
    assert report["ordered_by"] == "tokens_per_s_per_gpu" and report["use"].startswith("use #1")
    for row in layouts:
        assert row["ms_per_iteration"] > 0 and row["why"].startswith(f"{milliseconds(row['ms_per_iteration'] / 1e3)} "
                                                                    f"ms/iteration")
    split = next(row for row in layouts if row["layout"]["encoder_ranks"] or row["layout"]["llm_pp"] > 1)
    assert "slower stage" in split["why"] and split["slower_stage"]
    text = " ".join(suggest().split())
    assert "most tokens/s/GPU first" in text and "use #1" in text and "#1 " in text
    assert milliseconds(4.0333) == "4,033" and milliseconds(0.024) == "24" and milliseconds(0.00031) == "0.31"


def test_without_model_flops_the_order_is_least_communication_and_says_so():
    from mimo.core.config import LaunchOptions, RunConfig, TrainingOptions
    from mimo.core.memory import layout_search
    from mimo.core.run.plan import prepare
    from mimo.core.step_time.advisor import advise

    plan = prepare(RunConfig(provider="mock-vlm", launch=LaunchOptions(nproc_per_node=4),
                             training=TrainingOptions(device="cuda", precision="bf16")), world_size=4)

    class NoFlops:
        def __init__(self, hooks):
            self._hooks = hooks

        def __getattr__(self, name):
            return (lambda settings: None) if name == "model_flops" else getattr(self._hooks, name)

    timed = advise(plan, 4, 80)
    plan.hooks = NoFlops(plan.hooks)
    untimed = advise(plan, 4, 80)
    assert "no FLOPs per module (model_flops)" in untimed.note and not untimed.verdict
    expected = [s.flags() for s in layout_search.suggest(plan, 4, 80)]
    assert [a.suggestion.flags() for a in untimed.layouts] == expected
    assert all(a.estimate is None for a in untimed.layouts)
    assert [a.suggestion.flags() for a in timed.layouts] != expected  # the time changes the order here


# --- context parallelism: proposed where the sequence's activations need it, priced by its key/value ring

LONG = ["seq_length=65536", "hidden_size=1024", "num_layers=4", "num_attention_heads=1"]  # no TP: 1 head


def mock_plan(gpus, settings=(), micro_batch_size=1):
    from mimo.core.config import LaunchOptions, RunConfig, TrainingOptions
    from mimo.core.run.plan import prepare

    return prepare(RunConfig(provider="mock-vlm", provider_settings=list(settings),
                             launch=LaunchOptions(nproc_per_node=gpus),
                             training=TrainingOptions(device="cuda", precision="bf16",
                                                      micro_batch_size=micro_batch_size)),
                   world_size=gpus)


def test_cp_ring_sends_the_local_keys_and_values_per_attention_layer():
    cp = {"images": ModuleParallelism(0, 4), LANGUAGE: ModuleParallelism(0, 4, cp=2)}
    base = inputs(cp)
    modules = {**base.modules, LANGUAGE: dataclasses.replace(base.modules[LANGUAGE], attention_layers=4,
                                                             kv_values=256)}
    est = estimate(dataclasses.replace(base, modules=modules), CAL)
    # 4 micro-batches x 2 lanes = 8 samples, 2 a lane's CP rank pair shares: 2 samples' worth of 1000 tokens a rank
    local_kv = 2 * 1000 * 256 * 2
    assert est.slowest.terms["CP key/value ring"] == pytest.approx(3 * 1 * 4 * local_kv / 1e9)
    # the encoders are not split over CP: each rank runs its lane's 4 samples
    assert est.slowest.terms["encoder compute"] == pytest.approx(4 * 3 * 1.0)


def test_colocated_encoders_at_their_own_tp_send_their_embeddings_to_the_llms_layout():
    lane_rows = 4 * 100 * 128 * 2  # a lane's 4 samples x 100 encoder tokens x the LLM's 128 wide, bf16
    fan_in = estimate(inputs({"images": ModuleParallelism(0, 2), LANGUAGE: ModuleParallelism(0, 2, tp=2)}), CAL)
    # the LLM's one lane gathered from the two encoder ranks: each sends half of it
    assert fan_in.slowest.terms["embedding exchange"] == pytest.approx(lane_rows / 2 / 1e9)
    assert fan_in.slowest.terms["encoder compute"] == pytest.approx(2 * 3 * 1.0)  # each rank encodes 2 samples
    fan_out = estimate(inputs({"images": ModuleParallelism(0, 2, tp=2), LANGUAGE: ModuleParallelism(0, 2)}), CAL)
    # backward, the two lanes' gradients gathered on both ranks of the one encoder replica
    assert fan_out.slowest.terms["embedding exchange"] == pytest.approx(2 * lane_rows / 2 / 1e9)
    alike = estimate(inputs({"images": ModuleParallelism(0, 2), LANGUAGE: ModuleParallelism(0, 2)}), CAL)
    assert "embedding exchange" not in alike.slowest.terms


def test_the_llms_stages_beside_the_encoders_run_after_the_encoders_pass():
    beside = {"images": ModuleParallelism(0, 2), LANGUAGE: ModuleParallelism(0, 2, pp=2)}
    est = estimate(inputs(beside), CAL)
    assert [s.name for s in est.stages] == ["LLM stage 0", "LLM stage 1"]
    # gathered forward, summed backward over the two stages' ranks
    exchange = 3 * (4 * 100 * 128 * 2) / 2 / 1e9
    assert est.stages[0].terms["embedding exchange"] == pytest.approx(exchange)
    # each rank encodes its 2 samples first (6 s); then each stage's half of the LLM, 3 s a micro-batch: 4 x 3 + 3
    assert est.pipeline_s == pytest.approx(6 + exchange + 4 * 3 + 3)


def test_suggest_ranks_the_shared_rank_layouts_with_the_others():
    from mimo.core.step_time.advisor import advise

    # a micro-batch of 2: each of the LLM's 2 stages' ranks encodes one sample of it
    layouts = [a.suggestion.layout for a in advise(mock_plan(2, micro_batch_size=2), 2, 80, top=100).layouts]
    assert any(lo.encoder_ranks == 0 and lo.encoder_tp != lo.llm_tp for lo in layouts)  # own TP, colocated
    assert any(lo.encoder_ranks == 0 and lo.llm_pp == 2 for lo in layouts)  # the LLM's stages beside
    assert any(lo.encoder_ranks == 1 for lo in layouts) and any(lo.encoder_tp == lo.llm_tp == 1 for lo in layouts)


def test_a_sequence_that_fits_only_with_cp_gets_a_cp_layout_first():
    from mimo.core.step_time.advisor import advise

    advised = advise(mock_plan(2, LONG), 2, 5.5)
    first = advised.layouts[0]
    assert first.suggestion.layout.llm_cp == 2 and "--llm-cp 2" in first.suggestion.flags()
    assert "splits the 65,536-token sequence over 2 ranks: activations per GPU" in first.why
    assert "CP key/value ring" in first.estimate.slowest.terms
    assert all(a.suggestion.layout.llm_cp > 1 for a in advised.layouts)  # nothing else fits 5.5 GiB


def test_a_short_sequence_keeps_its_layout_without_cp_first():
    from mimo.core.step_time.advisor import advise

    layouts = advise(mock_plan(4), 4, 80, top=100).layouts
    assert layouts[0].suggestion.layout.llm_cp == 1
    assert any(a.suggestion.layout.llm_cp > 1 for a in layouts)  # considered, and slower


def test_cp_is_proposed_colocated_and_split_packed_on_gpus_never_with_cuda_graphs():
    from pathlib import Path

    from mimo.core.memory import layout_search

    plan = mock_plan(4, LONG)
    found = layout_search.fitting(plan, 4, 80)
    assert any(s.layout.llm_cp > 1 and not s.layout.encoder_ranks for s in found)
    # on the LLM's own ranks too (the bridge feeds every CP rank), where the LLM's ranks divide
    split = [s.layout for s in found if s.layout.encoder_ranks and s.layout.llm_cp > 1]
    assert split and all((4 - lo.encoder_ranks) % (lo.llm_cp * lo.llm_tp * lo.llm_pp) == 0 for lo in split)
    config = plan.config
    packed = dataclasses.replace(config.data, data=Path("rows.jsonl"), pack_sequences=True)
    plan.config = dataclasses.replace(config, data=packed)  # a plan for GPUs: transformer-engine splits packed rows
    assert any(s.layout.llm_cp > 1 for s in layout_search.fitting(plan, 4, 80))
    plan.config = dataclasses.replace(config, data=packed,
                                      training=dataclasses.replace(config.training, device="cpu", precision="fp32"))
    assert all(s.layout.llm_cp == 1 for s in layout_search.fitting(plan, 4, 80))
    plan.config = dataclasses.replace(config, performance=dataclasses.replace(config.performance, cuda_graphs=True))
    assert all(s.layout.llm_cp == 1 for s in layout_search.fitting(plan, 4, 80))


def test_cp_is_not_proposed_where_the_provider_refuses_it():
    """nemotron's local Mamba mixer has no CP: on this CPU the search builds its spec per (TP, CP) as `mimo plan`
    does for a given layout, and proposes no CP layout the plan would refuse."""
    from mimo.core.config import LaunchOptions, RunConfig, TrainingOptions
    from mimo.core.memory import layout_search
    from mimo.core.run.plan import prepare

    plan = prepare(RunConfig(provider="nemotron-moe-vlm-tiny", provider_settings=["seq_length=65536"],
                             launch=LaunchOptions(nproc_per_node=2),
                             training=TrainingOptions(device="cpu", micro_batch_size=1)), world_size=2)
    found = layout_search.fitting(plan, 2, 80)
    assert found and all(s.layout.llm_cp == 1 for s in found)
    # nor sequence parallelism (the MoE LLM's TP), which the CPU plan and the local backend refuse alike
    assert not any(s.sequence_parallel or s.layout.llm_tp > 1 for s in found)


def test_mimo_plan_names_each_modules_share_of_the_forward_flops():
    from mimo.cli.plan import _flop_split

    assert _flop_split({"images": 16.52e12, "language": 15.82e12}) == (
        "forward FLOPs per sample: images 16.52 TFLOP (51%), language 15.82 TFLOP (49%)")
    assert _flop_split({"images": 4e6, "language": 16e6}).endswith("language 16.00 MFLOP (80%)")
