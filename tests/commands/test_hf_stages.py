"""docs/checkpoints.md's training stages run as written: a tiny random omni model imported, stage 1 and stage 2
trained on a captions dataset (energon), and stage 2 exported; each stage moves exactly the weights it trains."""

from __future__ import annotations

import random
import re
import shlex

import torch
from format_datasets import QUICK_LOOKS, build_captions
from helpers import REPO, run_mimo
from safetensors.torch import load_file

DOC = REPO / "docs" / "checkpoints.md"
ENV = {"TORCH_COMPILE_DISABLE": "1"}


def recipe() -> list[str]:
    section = DOC.read_text().split("### Training stages from an omni checkpoint", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def _changed(exported, original) -> set[str]:
    """The top-level parts (vision_model, mlp1, language_model) with a tensor that differs from the original."""
    got, want = load_file(exported / "model.safetensors"), load_file(original / "model.safetensors")
    assert sorted(got) == sorted(want)
    return {name.split(".")[0] for name, t in want.items() if not torch.equal(got[name], t)}


def test_the_documented_stage_recipe_runs_and_trains_what_each_stage_names(tmp_path, omni_folder):
    hf_dir, data = omni_folder, tmp_path / "captions"  # save_omni(), built once per test run (conftest.py)
    build_captions(data, random.Random(0), QUICK_LOOKS)
    runs = tmp_path / "runs"
    imported = None
    for line in recipe():
        line = line.replace("HF_DIR", str(hf_dir)).replace("DATA", str(data)).replace("runs/", f"{runs}/")
        argv = shlex.split(line)
        assert argv[0] == "mimo", line
        if argv[1] == "run":
            argv[argv.index("PROVIDER")] = imported
            argv += ["--device", "cpu"]
        result = run_mimo(*argv[1:], env=ENV)
        assert result.returncode == 0, (line, result.stderr[-3000:])
        if argv[1:3] == ["ckpt", "import-hf"]:
            imported = re.search(r"as provider ([\w.-]+)", result.stdout).group(1)
    assert (runs / "hf-stage2" / "model.safetensors").is_file()

    # Stage 1 moved the projector only (the frozen LLM's MoE expert bias included); stage 2 the projector and the
    # LLM; RADIO is never trained.
    assert run_mimo("ckpt", "export-hf", str(runs / "stage1"), str(tmp_path / "hf-stage1"), env=ENV).returncode == 0
    assert _changed(tmp_path / "hf-stage1", hf_dir) == {"mlp1"}
    assert _changed(runs / "hf-stage2", hf_dir) == {"mlp1", "language_model"}
