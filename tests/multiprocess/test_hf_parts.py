"""A VLM from separately released parts (docs/checkpoints.md, "A VLM from an LLM and an encoder"): tiny random
`nemotron_h` and `radio` models saved by transformers, assembled by `mimo run --pretrained-llm --pretrained-vision`,
stage 1 and stage 2 on a captions dataset, exported as an omni folder that transformers loads; the same assembly in
other layouts, under torchrun and through `mimo ckpt import-hf --llm --vision` gives the same first loss."""

from __future__ import annotations

import os
import random
import re
import shlex
import subprocess
import sys

import pytest
import torch
from format_datasets import QUICK_LOOKS, build_captions
from helpers import REPO, read_metrics, run_mimo
from hf_models import DENSE_TEXT, save_llm, save_radio

DOC = REPO / "docs" / "checkpoints.md"
PROVIDER = "nemotron-moe-vlm-tiny"
ENV = {"TORCH_COMPILE_DISABLE": "1"}
PROJECTOR = ("--set", "projection=mlp", "--set", "projection_norm=true")
RUN = ("run", "--provider", PROVIDER, "--device", "cpu", "--train-iters", "1", "--set", "stage=stage1", *PROJECTOR)


def _mimo(*args: str):
    result = run_mimo(*args, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not result.stderr.strip(), result.stderr[-3000:]
    return result


def _tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("parts")
    return save_llm(root / "llm"), save_radio(root / "radio")


def recipe() -> list[str]:
    section = DOC.read_text().split("### A VLM from an LLM and an encoder", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_the_documented_recipe_assembles_trains_and_exports_what_transformers_computes(parts, tmp_path):
    llm, radio = parts
    data = tmp_path / "captions"
    build_captions(data, random.Random(0), QUICK_LOOKS)
    runs = tmp_path / "runs"
    outputs = []
    for line in recipe():
        line = (line.replace("PROVIDER", PROVIDER).replace("LLM_DIR", str(llm)).replace("RADIO_DIR", str(radio))
                .replace("DATA", str(data)).replace("runs/", f"{runs}/"))
        argv = shlex.split(line)
        assert argv[0] == "mimo", line
        if argv[1] == "run":
            argv += ["--device", "cpu"]
        outputs.append(_mimo(*argv[1:]).stdout)
    assert "starts from initialization: modality_submodules.images.input_projections.0.* (3 tensors)" in outputs[0]
    assert "note: RADIO has no video patch embedder" in outputs[-1]

    # Stage 1 trained the projector alone: the LLM and RADIO are the source files' bits, expert bias included.
    stage1 = tmp_path / "hf-stage1"
    _mimo("ckpt", "export-hf", str(runs / "vlm1"), str(stage1))
    got, source_llm, source_radio = _tensors(stage1), _tensors(llm), _tensors(radio)
    assert all(torch.equal(got["language_model." + n], t) for n, t in source_llm.items())
    assert all(torch.equal(got["vision_model." + n], t) for n, t in source_radio.items()
               if not n.startswith("radio_model.input_conditioner."))  # the omni processor normalizes
    final = _tensors(runs / "hf-vlm")
    assert not torch.equal(got["mlp1.1.weight"], final["mlp1.1.weight"])  # stage 2 trained the projector on
    assert any(not torch.equal(final["language_model." + n], t) for n, t in source_llm.items())  # and the LLM
    assert all(torch.equal(final[n], t) for n, t in got.items() if n.startswith("vision_model."))

    from transformers import NemotronHForCausalLM, RadioModel
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    omni, info = NemotronH_Omni_Reasoning_V3.from_pretrained(stage1, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = torch.tensor([[5, 17, 99, 3, 200, 41, 7, 8, 120, 64]])
    with torch.no_grad():
        want = NemotronHForCausalLM.from_pretrained(llm).eval()(input_ids=ids).logits
        logits = omni.eval().language_model(input_ids=ids).logits
    assert ((logits - want).abs().max() / want.abs().max()).item() <= 1e-5
    encoder = RadioModel.from_pretrained(radio).eval()
    encoder.make_preprocessor_external()  # the omni model's RADIO gets normalized pixels
    patches, grid = torch.randn(24, 3 * 16 * 16, generator=torch.Generator().manual_seed(0)), torch.tensor([[4, 6]])
    with torch.no_grad():
        assert torch.equal(omni.vision_model(patches, image_grid_hw=grid).features,
                           encoder(patches, image_grid_hw=grid).features)


def _first_loss(tmp_path, name: str, *args: str, torchrun: int = 0) -> float:
    metrics = tmp_path / f"{name}.jsonl"
    if torchrun:  # no mimo launcher: torchrun starts the ranks, each reads its slices itself
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun),
                   "--master-port", str(29500 + os.getpid() % 1000), "-m", "mimo.cli", *RUN, *args,
                   "--metrics-file", str(metrics)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                                env={**os.environ, **ENV, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    else:
        _mimo(*RUN, *args, "--metrics-file", str(metrics))
    return read_metrics(metrics)[0]["lm_loss"]


def test_other_layouts_torchrun_and_import_hf_give_the_first_loss_of_one_process(parts, tmp_path):
    llm, radio = parts
    given = ("--pretrained-llm", str(llm), "--pretrained-vision", str(radio))
    one = _first_loss(tmp_path, "one", *given)
    assert _first_loss(tmp_path, "heterogeneous", *given, "--encoder-ranks", "1", torchrun=2) == pytest.approx(
        one, rel=1e-6)
    imported = tmp_path / "imported"
    _mimo("ckpt", "import-hf", str(imported), "--llm", str(llm), "--vision", str(radio), *PROJECTOR)
    from_import = _first_loss(tmp_path, "import", "--provider-config", str(imported / "provider.yaml"),
                              "--pretrained", str(imported))
    assert from_import == one

    # MoE under TP needs sequence parallelism (transformer-engine); the CPU checks TP with a dense LLM.
    dense = save_llm(tmp_path / "dense", DENSE_TEXT)
    given = ("--pretrained-llm", str(dense), "--pretrained-vision", str(radio))
    one = _first_loss(tmp_path, "dense", *given)
    tp2 = _first_loss(tmp_path, "tp2", *given, "--nproc-per-node", "2", "--llm-tp", "2", "--encoder-tp", "2")
    assert tp2 == pytest.approx(one, rel=1e-6)


def test_settings_that_differ_from_the_parts_are_one_line_each(parts, tmp_path):
    llm, radio = parts
    given = ("--pretrained-llm", str(llm), "--pretrained-vision", str(radio))
    result = run_mimo(*RUN, *given, "--set", "hidden_size=32", "--set", "vision_layers=3", env=ENV)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --pretrained-llm {llm} has hidden_size=64 (its config.json), this run sets 32 (--set)",
        f"error: --pretrained-vision {radio} has vision_layers=2 (its config.json), this run sets 3 (--set)"]
    result = run_mimo(*RUN, "--pretrained-llm", str(llm), "--pretrained-vision", str(llm), env=ENV)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: --pretrained-vision {llm}: provider '{PROVIDER}' does not read Hugging Face model_type "
        f"'nemotron_h' as a vision encoder"]
    result = run_mimo(*RUN, "--pretrained", str(llm), "--pretrained-vision", str(radio), env=ENV)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    result = run_mimo("ckpt", "import-hf", str(llm), str(tmp_path / "out"), env=ENV)
    assert result.returncode == 2 and "give it as a part (mimo run --pretrained-llm DIR, or mimo ckpt import-hf " \
                                      "--llm DIR OUT)" in result.stderr
