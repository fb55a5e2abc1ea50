"""`mimo generate` against transformers' `generate` (the issue's parity target): a tiny random
`NemotronH_Omni_Reasoning_V3` saved by transformers, read by mimo with `--pretrained HF_DIR`, answers a prompt with an
image greedily with the same 32 tokens as transformers on the same token ids and image patches; and again after
mimo trained it a few iterations and exported it back (`mimo ckpt export-hf`).

"The same image" means the same patches: mimo's image mode cuts the picture (transformers' processor would choose
its own grid and resize), and both models get those patches. transformers does not clamp the Mamba step size in
its one-token path (mimo clamps as in the prompt's scan, as recomputing would): these weights never reach the
clamp, so the tokens agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_mimo

PROVIDER = "nemotron-moe-vlm-tiny"
ENV = {"TORCH_COMPILE_DISABLE": "1"}
QUESTION = "What is in the picture?"
NEW_TOKENS = 32


def _mimo(*args: str):
    result = run_mimo(*args, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    from PIL import Image

    path = tmp_path_factory.mktemp("image") / "picture.png"
    pixels = (torch.rand(40, 72, 3, generator=torch.Generator().manual_seed(5)) * 255).to(torch.uint8)
    Image.fromarray(pixels.numpy()).save(path)
    return path


def mimo_tokens(image: Path, *source: str) -> list[int]:
    result = _mimo("generate", *source, "--device", "cpu", "--prompt", QUESTION, "--image", str(image),
                   "--max-new-tokens", str(NEW_TOKENS), "--json")
    return json.loads(result.stdout)["tokens"]


def transformers_tokens(hf_dir: Path, image: Path) -> list[int]:
    """transformers' greedy generate on mimo's token ids and image patches, stopping at the same tokens."""
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    from mimo.core.checkpoint.saved_run import saved_run
    from mimo.data.prompts import encode, from_text
    from mimo.plugins import Registry
    from mimo.plugins.settings import build_settings

    saved = saved_run(hf_dir)
    registry = Registry()
    settings = build_settings(registry.get(saved.provider)[0], run_file_values=saved.settings)
    fmt = registry.hooks(saved.provider).prompt_format(settings=settings)
    encoded = encode(from_text(QUESTION, [image]), fmt)
    patches = encoded.modality_inputs["images"]["radio"]
    stop = sorted(fmt.template.stop_ids(fmt.tokenizer))
    model = NemotronH_Omni_Reasoning_V3.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(input_ids=encoded.input_ids, pixel_values=patches["x"][0],
                             image_grid_hw=patches["imgs_sizes"] // settings.patch_size, max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=stop, pad_token_id=fmt.tokenizer.pad_id)
    tokens = out[0, encoded.num_tokens:].tolist()
    return tokens[:-1] if tokens and tokens[-1] in stop else tokens  # mimo's answer leaves the stop token out


def test_mimo_generate_gives_transformers_tokens_before_and_after_training(tmp_path, image, omni_folder,
                                                                         omni_imported):
    hf_dir = omni_folder  # save_omni(TEXT), built once per test run (conftest.py)
    want = transformers_tokens(hf_dir, image)
    assert len(want) >= 8, want  # a real answer to compare, not an immediate stop
    assert mimo_tokens(image, "--pretrained", str(hf_dir)) == want

    (imported, _), trained, exported = omni_imported, tmp_path / "trained", tmp_path / "exported"  # import-hf of hf_dir
    _mimo("run", "--provider", PROVIDER, "--provider-config", str(imported / "provider.yaml"), "--pretrained",
          str(imported), "--device", "cpu", "--train-iters", "3", "--lr", "1e-3", "--save", str(trained))
    _mimo("ckpt", "export-hf", str(trained), str(exported))
    after = transformers_tokens(exported, image)
    assert after != want  # training changed the answer
    assert mimo_tokens(image, "--load", str(trained)) == after
