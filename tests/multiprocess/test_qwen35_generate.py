"""`mimo generate` of the Qwen3.5 VLM against transformers' `generate`: a tiny random `Qwen3_5ForConditionalGeneration`
written by transformers, read with `--pretrained HF_DIR`, answers a prompt with an image greedily with the same
tokens as transformers on the same token ids and pixels. The prompt's image placeholders take 3-D positions
(the prompt format's positions hook) and the answer goes on from the largest position + 1, as transformers' rope
deltas do; text positions (0 .. L-1) give other tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from helpers import run_mimo
from qwen35_models import TOKENS, save_reference

ENV = {"TORCH_COMPILE_DISABLE": "1"}
QUESTION = "What is in the picture?"
NEW_TOKENS = 24
PIXELS = ("--set", "min_pixels=256", "--set", "max_pixels=2048")  # the reference's 4-pixel patches: 16 tokens at most


def _image(folder: Path) -> Path:
    from PIL import Image

    path = folder / "picture.png"
    pixels = (torch.rand(40, 56, 3, generator=torch.Generator().manual_seed(5)) * 255).to(torch.uint8)
    Image.fromarray(pixels.numpy()).save(path)
    return path


def _transformers_tokens(reference, hf_dir: Path, image: Path, text_positions: bool = False) -> list[int]:
    """transformers' greedy generate on mimo's token ids and pixels (mimo's prompt format of the folder's
    settings). `text_positions`: the prompt's positions 0 .. L-1 instead (what decoding without the hook gave)."""
    from mimo.data.prompts import encode, from_text
    from mimo.providers import qwen35

    fields = qwen35.hf_settings(hf_config=json.loads((hf_dir / "config.json").read_text()), part="model")
    settings = qwen35.Qwen35Settings(**{**qwen35.TINY, **fields, "min_pixels": 256, "max_pixels": 2048})
    fmt = qwen35.prompt_format(settings=settings)
    encoded = encode(from_text(QUESTION, [image]), fmt)
    images = encoded.modality_inputs["images"]["visual"]
    ids = encoded.input_ids
    kwargs = dict(input_ids=ids, pixel_values=images["pixel_values"], image_grid_thw=images["grid_thw"],
                  mm_token_type_ids=(ids == TOKENS["image_token_id"]).int(), max_new_tokens=NEW_TOKENS,
                  do_sample=False, pad_token_id=0)
    if text_positions:
        kwargs["position_ids"] = torch.arange(ids.shape[1])[None].expand(3, 1, -1)
    with torch.no_grad():
        out = reference.generate(**kwargs)
    return out[0, ids.shape[1]:].tolist()


def test_mimo_generate_gives_transformers_tokens_for_a_prompt_with_an_image(tmp_path):
    reference, hf_dir = save_reference(tmp_path / "hf")
    image = _image(tmp_path)
    want = _transformers_tokens(reference.eval(), hf_dir, image)
    result = run_mimo("generate", "--provider", "qwen3.5-vl-tiny", "--pretrained", str(hf_dir), *PIXELS, "--device",
                      "cpu", "--prompt", QUESTION, "--image", str(image), "--max-new-tokens", str(NEW_TOKENS),
                      "--json", env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout)["tokens"]
    assert len(want) == NEW_TOKENS and got == want
    assert _transformers_tokens(reference, hf_dir, image, text_positions=True) != want  # the positions matter
