"""LoRA runs end to end (CPU, gloo): the loss falls; TP 2, a heterogeneous layout, PP 2, the step encoder pass and
(Nemotron's experts, both adapter layouts, SequentialMLP and grouped-GEMM experts) EP 2 give the single process's
losses; the checkpoint holds the adapters alone and names the base; a resume is exact; merge-lora's whole model
evaluates as base + adapters."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import read_metrics, run_mimo

LORA = ("--lora-rank", "4", "--lr", "1e-2")
PLAIN = ("run", "--provider", "mock-vlm", "--device", "cpu", "--log-interval", "1", "--micro-batch-size", "4",
         "--global-batch-size", "8", "--seed", "3")
MOCK = (*PLAIN, *LORA)
NEMOTRON = ("run", "--provider", "nemotron-moe-vlm-tiny", "--device", "cpu", "--log-interval", "1",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--seed", "3")
NO_COMPILE = {"TORCH_COMPILE_DISABLE": "1"}  # megatron-core's fused MoE activation: nothing to gain on a CPU


def _losses(tmp_path, name, *args, env=None):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_mimo(*args, "--metrics-file", str(metrics), env=env)
    assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
    return [(m["lm_loss"], m["grad_norm"]) for m in read_metrics(metrics)], result


@pytest.fixture(scope="module")
def mock_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    runs = {name: _losses(out, name, *MOCK, "--train-iters", "12", *args)[0] for name, args in {
        "single": (),
        "tp2": ("--nproc-per-node", "2", "--llm-tp", "2", "--encoder-tp", "2"),
        "heterogeneous": ("--nproc-per-node", "2", "--encoder-ranks", "1"),
        "encoder-pass-step": ("--encoder-pass", "step"),  # the encoders once per step, their backward once
    }.items()}
    return runs


def test_a_lora_run_learns(mock_runs):
    losses = [loss for loss, _ in mock_runs["single"]]  # 5.567 5.485 ... 5.323 5.314 (a random base)
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1


@pytest.mark.parametrize("layout", ["tp2", "heterogeneous", "encoder-pass-step"])
def test_layouts_give_the_single_process_losses(mock_runs, layout):
    for (loss, norm), (ref_loss, ref_norm) in zip(mock_runs[layout], mock_runs["single"]):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4)


def test_expert_parallel_adapters_give_the_single_process_losses(tmp_path):
    """The base saved once (expert weights are drawn per expert-parallel rank: layouts start alike from a
    checkpoint), then adapters on attention, Mamba and experts in one process and over EP 2, on megatron-core's
    SequentialMLP experts and on mimo's grouped-GEMM experts (their adapter terms in the grouped GEMMs)."""
    result = run_mimo(*NEMOTRON, "--train-iters", "1", "--save", str(tmp_path / "base"), env=NO_COMPILE)
    assert result.returncode == 0, result.stderr[-3000:]
    for layout in ("shared", "per-expert"):
        common = (*NEMOTRON, "--train-iters", "3", "--pretrained", str(tmp_path / "base"), *LORA,
                  "--lora-experts", layout)
        single, _ = _losses(tmp_path, f"{layout}-1", *common, env=NO_COMPILE)
        ep2 = ("--nproc-per-node", "2", "--llm-ep", "2")
        for name, args in {"ep2": ep2, "grouped": ("--set", "expert_gemm=grouped_mm"),
                           "grouped-ep2": ("--set", "expert_gemm=grouped_mm", *ep2)}.items():
            losses, _ = _losses(tmp_path, f"{layout}-{name}", *common, *args, env=NO_COMPILE)
            assert len(losses) == len(single) == 3
            for (loss, norm), (ref_loss, ref_norm) in zip(losses, single):
                assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4), (
                    layout, name)


def test_adapter_checkpoints_resume_exactly_and_merge(tmp_path):
    """The run says it trains adapters (first lines, summary, inspect: rank, targets, trainable parameters as the
    checkpoint holds them, the base); the checkpoint carries its base: a resume, eval and generate take the base
    and the --lora-* options from it (checked, said in one line), and refuse in one line once the base is gone."""
    base, adapters, merged = tmp_path / "base", tmp_path / "adapters", tmp_path / "merged"
    result = run_mimo(*PLAIN, "--train-iters", "1", "--save", str(base))
    assert result.returncode == 0, result.stderr[-3000:]
    straight, _ = _losses(tmp_path, "straight", *MOCK, "--train-iters", "4", "--pretrained", str(base))
    first, run = _losses(tmp_path, "first", *MOCK, "--train-iters", "2", "--pretrained", str(base),
                         "--save", str(adapters))
    # resumed with neither --pretrained nor --lora-rank: both from the checkpoint
    second, resumed = _losses(tmp_path, "second", *PLAIN, "--lr", "1e-2", "--train-iters", "4",
                              "--load", str(adapters), "--save", str(adapters))
    assert first + second == straight  # bit for bit
    recorded = f"--pretrained {base.resolve()} (iteration 1)"
    assert f"mimo run: lora_rank=4 from {adapters}/iter_0000002" in resumed.stdout
    assert f"mimo run: base {recorded}, recorded by {adapters}/iter_0000002, unchanged since" in resumed.stdout

    # adapters alone, a fraction of the whole model's checkpoint, naming the base by path and fingerprint
    def size(directory):
        return sum(p.stat().st_size for p in directory.glob("__*.distcp"))

    assert size(adapters / "iter_0000004") < size(base / "iter_0000001") / 4  # with Adam's moments both
    common = torch.load(adapters / "iter_0000004" / "common.pt", weights_only=False)
    folder = common["adapters"]["folders"]["pretrained"]
    assert folder["path"] == str(base.resolve()) and len(folder["checksum"]) == 16 and folder["iteration"] == 1
    assert common["contents"]["adapters"] is True

    # what trains, said where the run starts and ends and by inspect: the adapter tensors the checkpoint holds
    from mimo.plugins.kit.dist_checkpoint import saved_tensor_shapes

    held = sum(torch.Size(shape).numel() for key, (shape, _) in saved_tensor_shapes(adapters / "iter_0000004").items()
               if ".lora" in key and not key.startswith("mimo."))
    total = sum(common["run"]["parameters"].values()) + held
    trainable = f"{held:,} trainable params ({100 * held / total:.1f}% of {total:,})"
    lines = run.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("mimo run: provider"))
    assert lines[header].endswith(f" | LoRA rank 4, {trainable}")
    assert lines[header + 1].startswith("LoRA adapters: rank 4, alpha 8 on language: linear_qkv, linear_proj, "
                                        "linear_fc1, linear_fc2; images: ")
    assert lines[header + 1].endswith(f"trainable params; base {recorded}, frozen")
    assert f"  LoRA: rank 4 adapters, {trainable}, on base {recorded}; checkpoints hold the adapters alone" in lines
    inspect = run_mimo("ckpt", "inspect", str(adapters), "--json")
    found = json.loads(inspect.stdout)["adapters"]
    assert sum(found["parameters"].values()) == found["trainable"] == held and found["rank"] == 4
    assert found["base_status"].startswith("it is unchanged since")
    text = run_mimo("ckpt", "inspect", str(adapters)).stdout
    assert "adapter parameters" in text and f"{held:,} trainable parameters" in text

    result = run_mimo("ckpt", "merge-lora", str(adapters), str(merged))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"into their base {recorded}, recorded by {adapters}/iter_0000004" in result.stdout
    evaluate = ("eval", "--device", "cpu", "--eval-iters", "2", "--micro-batch-size", "4", "--global-batch-size", "8")
    with_adapters = run_mimo(*evaluate, "--load", str(adapters))  # its base from the record
    whole = run_mimo(*evaluate, "--load", str(merged))
    assert with_adapters.returncode == whole.returncode == 0, with_adapters.stderr[-2000:] + whole.stderr[-2000:]
    assert f"mimo eval: base {recorded}, recorded by {adapters}/iter_0000004, unchanged since" in with_adapters.stdout

    def eval_loss(out):
        line = next(line for line in out.splitlines() if line.startswith("validation"))
        return float(line.split("lm loss ")[1].split()[0])

    assert eval_loss(whole.stdout) == pytest.approx(eval_loss(with_adapters.stdout), rel=1e-6)

    generate = ("generate", "--device", "cpu", "--prompt", "a photo of", "--max-new-tokens", "6")
    answers = [run_mimo(*generate, "--load", str(where)) for where in (adapters, merged)]
    assert all(a.returncode == 0 for a in answers), answers[0].stderr[-2000:] + answers[1].stderr[-2000:]
    assert answers[0].stdout.splitlines()[-1] == answers[1].stdout.splitlines()[-1]  # greedy: the same answer

    # the base moved away: one line, before anything is built; given where it is now, it loads
    base.rename(tmp_path / "moved")
    refused = run_mimo(*generate, "--load", str(adapters))
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        f"error: the adapters in {adapters}/iter_0000004 were trained on --pretrained {base.resolve()}, which is no "
        f"longer there: give --pretrained PATH holding those weights")
    moved = run_mimo(*generate, "--load", str(adapters), "--pretrained", str(tmp_path / "moved"))
    assert moved.returncode == 0 and moved.stdout.splitlines()[-1] == answers[0].stdout.splitlines()[-1]


def test_adapters_reshard_from_tp1_to_tp2(tmp_path):
    """Mamba's in_proj stacks z, x, B, C, dt per TP rank: its adapter's B is saved part by part as the weight is,
    so adapters saved in one process resume exactly over TP 2 (a dense Nemotron: MoE needs sequence parallelism
    under TP, and that transformer-engine)."""
    dense = (*NEMOTRON, "--set", "hybrid_pattern=M*M*")
    result = run_mimo(*dense, "--train-iters", "1", "--save", str(tmp_path / "base"), env=NO_COMPILE)
    assert result.returncode == 0, result.stderr[-3000:]
    lora = (*dense, "--pretrained", str(tmp_path / "base"), *LORA, "--lora-targets",
            "language:all;images:all;projection:all")
    straight, _ = _losses(tmp_path, "straight", *lora, "--train-iters", "4", env=NO_COMPILE)
    first, _ = _losses(tmp_path, "first", *lora, "--train-iters", "2", "--save", str(tmp_path / "a"), env=NO_COMPILE)
    second, _ = _losses(tmp_path, "second", *lora, "--train-iters", "4", "--load", str(tmp_path / "a"),
                        "--nproc-per-node", "2", "--llm-tp", "2", "--encoder-tp", "2", "--no-load-rng", env=NO_COMPILE)
    for (loss, norm), (ref_loss, ref_norm) in zip(first + second, straight):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4)


def test_pipeline_parallel_adapters_give_the_single_process_losses(tmp_path):
    """From one saved base (a pipeline split draws the LLM's initial weights otherwise): the adapters of each stage
    are seeded by their global layer number."""
    result = run_mimo(*PLAIN, "--train-iters", "1", "--save", str(tmp_path / "base"))
    assert result.returncode == 0, result.stderr[-3000:]
    common = (*MOCK, "--train-iters", "4", "--pretrained", str(tmp_path / "base"))
    single, _ = _losses(tmp_path, "single", *common)
    pipeline, _ = _losses(tmp_path, "pp2", *common, "--nproc-per-node", "3", "--encoder-ranks", "1", "--llm-pp", "2")
    for (loss, norm), (ref_loss, ref_norm) in zip(pipeline, single):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4)


def test_adapters_on_the_experts_alone_save_and_resume_exactly(tmp_path):
    """Adapters on the routed experts only (per expert): megatron-core gives the LLM's empty dense part a stub
    optimizer, which its chain's save once tripped over. Saved at iteration 2, resumed to 3: the uninterrupted run's
    third loss."""
    common = (*NEMOTRON, *LORA, "--lora-experts", "per-expert", "--lora-targets", "language:experts")
    whole, _ = _losses(tmp_path, "whole", *common, "--train-iters", "3", env=NO_COMPILE)
    _losses(tmp_path, "first", *common, "--train-iters", "2", "--save", str(tmp_path / "ck"), env=NO_COMPILE)
    resumed, _ = _losses(tmp_path, "resumed", *common, "--train-iters", "3", "--load", str(tmp_path / "ck"),
                         env=NO_COMPILE)
    assert resumed == whole[2:]
