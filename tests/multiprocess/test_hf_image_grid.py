"""An exported model sees images as mimo does: transformers' processor, loaded from the files `mimo ckpt export-hf`
writes, gives every image the patch grid, the prompt tokens and the pixels that mimo's data path gives it (images
from one pixel to past the largest grid, wide and tall), and a tiny trained model exported and run by transformers
alone answers greedily as `mimo generate` does on images of six sizes."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_mimo
from hf_models import TEXT, save_omni

PROVIDER = "nemotron-moe-vlm-tiny"
ENV = {"TORCH_COMPILE_DISABLE": "1"}
QUESTION = "What is in the picture?"
# (height, width): one pixel, below the fewest patches, the sizes the first report named (80x40, 320x240 and
# 100x300 as width x height), odd and even whole patches, past the most patches and past max_image_size
SIZES = [(1, 1), (8, 8), (17, 33), (40, 80), (240, 320), (300, 100), (48, 48), (80, 112), (64, 256), (256, 64),
         (600, 400), (1000, 3000), (5, 400)]


def _image(path, height: int, width: int, seed: int):
    from PIL import Image

    pixels = (torch.rand(height, width, 3, generator=torch.Generator().manual_seed(seed)) * 255).to(torch.uint8)
    Image.fromarray(pixels.numpy()).save(path)
    return path


def _settings(provider: str, **values):
    from mimo.plugins import Registry
    from mimo.plugins.settings import build_settings

    registry = Registry()
    settings = build_settings(registry.get(provider)[0], run_file_values=values)
    return settings, registry.hooks(provider).prompt_format(settings=settings)


@pytest.mark.parametrize("provider", [PROVIDER, "nemotron-moe-vlm-20l"])
def test_the_exported_processor_gives_every_image_mimos_grid_tokens_and_pixels(tmp_path, provider):
    from transformers import AutoProcessor

    from mimo.data.prompts import encode, from_text
    from mimo.providers.nemotron.hf.processor import processor_files

    settings, fmt = _settings(provider)
    folder = tmp_path / "hf"
    folder.mkdir()
    for name, text in processor_files(settings).items():  # the files export-hf writes beside the weights
        (folder / name).write_text(text)
    processor = AutoProcessor.from_pretrained(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    grids = set()
    for seed, (height, width) in enumerate(SIZES):
        path = _image(tmp_path / f"{height}x{width}.png", height, width, seed)
        from PIL import Image

        theirs = processor(images=[Image.open(path)], text=prompt, return_tensors="pt")
        ours = encode(from_text(QUESTION, [path]), fmt)
        patches = ours.modality_inputs["images"]["radio"]
        grid = (patches["imgs_sizes"] // settings.patch_size).tolist()
        assert theirs["image_grid_hw"].tolist() == grid, (height, width)
        assert theirs["input_ids"][0].tolist() == ours.input_ids[0].tolist(), (height, width)
        # the same resize (bicubic, antialiased) from bytes scaled to [0, 255] there, [0, 1] here
        torch.testing.assert_close(theirs["pixel_values"], patches["x"][0], atol=2e-5, rtol=1e-5)
        grids.add(tuple(grid[0]))
    assert len(grids) >= 8  # the sizes reach many grids, not one clamped corner


def test_a_trained_exported_model_answers_as_mimo_on_six_image_sizes(tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    hf_dir, trained, exported = save_omni(tmp_path / "hf", TEXT), tmp_path / "trained", tmp_path / "exported"
    for args in (("run", "--provider", PROVIDER, "--pretrained", str(hf_dir), "--device", "cpu", "--train-iters", "3",
                  "--lr", "1e-3", "--save", str(trained)),
                 ("ckpt", "export-hf", str(trained), str(exported))):
        result = run_mimo(*args, env=ENV)
        assert result.returncode == 0, result.stderr[-3000:]

    processor = AutoProcessor.from_pretrained(exported)
    model = AutoModelForImageTextToText.from_pretrained(exported, dtype=torch.float32).eval()
    stop = set(model.generation_config.eos_token_id)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    answers = []
    for seed, (height, width) in enumerate([(40, 80), (80, 40), (240, 320), (300, 100), (100, 300), (17, 33)]):
        path = _image(tmp_path / f"{height}x{width}.png", height, width, seed)
        inputs = processor(images=[Image.open(path)], text=prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
        want = out[0, inputs["input_ids"].shape[1]:].tolist()
        want = want[:-1] if want and want[-1] in stop else want  # mimo's answer leaves the stop token out
        result = run_mimo("generate", "--load", str(trained), "--device", "cpu", "--prompt", QUESTION, "--image",
                          str(path), "--max-new-tokens", "24", "--json", env=ENV)
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads(result.stdout)["tokens"] == want, (height, width)
        answers.append(want)
    assert min(len(a) for a in answers) >= 8, answers  # real answers, not an immediate stop
