"""`mimo run --pretrained DIR` with a Nemotron-format checkpoint (providers/nemotron/checkpoint.py through the
provider's `load_pretrained` hook): the same weights as a mimo checkpoint of them give the same first loss, in one
process and heterogeneous, whether DIR is the dist checkpoint itself or a Megatron-LM save directory with a
tracker; a checkpoint of another model shape is one line.

dist_checkpointing's saver starts a helper process, so the checkpoints are written in a process of its own (forked
from the tests' command server, helpers.forked_call); this file is also that script
(`python tests/multiprocess/test_nemotron_pretrained.py DIR`)."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
from helpers import forked_call, read_metrics, run_mimo

SCRIPT = Path(__file__).resolve()
PROVIDER = "nemotron-moe-vlm-tiny"
ENV = {"TORCH_COMPILE_DISABLE": "1"}
RUN = ("run", "--provider", PROVIDER, "--device", "cpu", "--train-iters", "1", "--lr", "0")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    forked_call(_main, (root,))  # as `python tests/multiprocess/test_nemotron_pretrained.py ROOT` runs it
    # Megatron-LM's save layout: a tracker naming an iteration directory (its common.pt is not mimo's).
    megatron = root / "megatron"
    shutil.copytree(root / "nemotron", megatron / "iter_0000007")
    (megatron / "latest_checkpointed_iteration.txt").write_text("7")
    return root


def _first_loss(tmp_path, name: str, *args: str) -> float:
    metrics = tmp_path / f"{name}.jsonl"
    result = run_mimo(*RUN, *args, "--metrics-file", str(metrics), env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(metrics)[0]["lm_loss"]


def test_a_nemotron_checkpoint_starts_a_run_like_the_mimo_checkpoint_of_the_same_weights(saved, tmp_path):
    want = _first_loss(tmp_path, "mimo", "--pretrained", str(saved / "mimo"))
    assert want != _first_loss(tmp_path, "random")  # the saved weights are not the ones a run starts from
    assert _first_loss(tmp_path, "nemotron", "--pretrained", str(saved / "nemotron")) == want
    heterogeneous = _first_loss(tmp_path, "split", "--pretrained", str(saved / "megatron"), "--nproc-per-node", "2",
                                "--encoder-ranks", "1")
    assert heterogeneous == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("setting, message", [
    ("hybrid_pattern=M*EMEM", r"lacks \d+ key\(s\) the model needs: language_model\.decoder\.layers\.5\."),
    ("hybrid_pattern=M*EM", r"holds \d+ weight\(s\) the model has no place for \(a model of other settings\?\): "
             r"language_model\.decoder\.layers\.4\."),
    ("moe_ffn_hidden_size=48", r"holds language_model\.decoder\.layers\.2\.mlp\.experts\S+ of shape \[\d+(, \d+)*\], the model's is \[\d+"),
])
def test_a_checkpoint_of_another_shape_is_one_line(saved, setting, message):
    result = run_mimo(*RUN, "--pretrained", str(saved / "nemotron"), "--set", setting, env=ENV)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]  # after megatron-core's own warnings from building the model
    assert last.startswith("error: Nemotron checkpoint ") and re.search(message, last), last


def test_a_folder_with_no_checkpoint_is_one_line(tmp_path):
    result = run_mimo(*RUN, "--pretrained", str(tmp_path), env=ENV)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --pretrained {tmp_path}: no checkpoint there (neither a latest_checkpointed_iteration.txt, a "
        f"Hugging Face config.json with safetensors, nor a dist checkpoint's .metadata)"]


def test_one_iteration_folder_of_a_mimo_run_names_its_save_directory(tmp_path):
    import torch

    from mimo.core.checkpoint.foreign import foreign_directory
    from mimo.errors import UsageError

    one = tmp_path / "run" / "iter_0000002"
    one.mkdir(parents=True)
    (one / ".metadata").write_bytes(b"")
    torch.save({"run": {"provider": "mock-vlm"}}, one / "common.pt")
    # it read as another framework's dist checkpoint, which the provider then did not recognise
    with pytest.raises(UsageError, match=rf"^--pretrained {one} is one checkpoint's folder of a mimo run; give the "
                                         rf"--save directory that holds it \(--pretrained {one.parent} loads"):
        foreign_directory(one)


def _main(root: Path) -> None:
    """One random model of nemotron-moe-vlm-tiny (moved away from the initialization a run would make), saved as a
    mimo checkpoint (root/mimo) and as a Nemotron-format checkpoint (root/nemotron)."""
    import torch
    from mimo.core.checkpoint.checkpointer import Checkpointer
    from mimo.core.checkpoint.layout import run_info
    from mimo.core.config import CheckpointOptions, RunConfig, TrainingOptions
    from mimo.core.run.plan import prepare
    from mimo.core.run.world import join
    from mimo.providers.nemotron.checkpoint import save_nemotron_checkpoint

    options = CheckpointOptions(save=root / "mimo", save_optim=False, save_rng=False)
    plan = prepare(RunConfig(provider=PROVIDER, checkpoint=options, training=TrainingOptions(
        micro_batch_size=1, train_iters=1, precision="fp32", device="cpu")), world_size=1)
    world = join(plan, seed=0)
    model = world.build_model()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    Checkpointer(options, model=model, topology=world.topology,
                 run_info=run_info(plan, plan.settings, lane_data_state=False)).save(0, 0)
    (root / "nemotron").mkdir()
    save_nemotron_checkpoint(model, str(root / "nemotron"))


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
