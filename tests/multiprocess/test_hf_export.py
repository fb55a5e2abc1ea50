"""Export from any recipe (docs/checkpoints.md, `mimo ckpt export-hf`): a tiny Nemotron run with Megatron-LM's affine
projection is told at start that its checkpoints cannot be exported and export names every setting at once (as
for a checkpoint saved when affine was the default); with the default settings, the export is a folder that transformers' AutoProcessor and AutoModelForImageTextToText load and
generate from an image and a prompt with; the folder rules and `--set` at export are one line each."""

from __future__ import annotations

import json
import stat

import pytest
from helpers import run_mimo

PROVIDER = "nemotron-moe-vlm-tiny"
ENV = {"TORCH_COMPILE_DISABLE": "1"}
RUN = ("run", "--provider", PROVIDER, "--device", "cpu", "--train-iters", "1")
AFFINE = ("--set", "projection=affine")  # Megatron-LM's recipe, one setting away from the default
REFUSED = "projection='affine'; to train an exportable model add --set projection=mlp"


def _mimo(*args: str):
    result = run_mimo(*args, env=ENV)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr[-3000:]
    return result.stdout


def _refused(*args: str) -> list[str]:
    result = run_mimo(*args, env=ENV)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stderr.strip().splitlines()


def test_affine_settings_are_told_at_start_and_export_names_every_setting_at_once(tmp_path):
    saved = tmp_path / "affine"
    lines = _mimo(*RUN, *AFFINE, "--save", str(saved)).splitlines()
    note = f"note: checkpoints of these settings cannot be exported to Hugging Face: {REFUSED}"
    assert note in lines and lines.index(note) < next(i for i, l in enumerate(lines) if l.startswith("iteration"))
    assert _refused("ckpt", "export-hf", str(saved), str(tmp_path / "out")) == [
        f"error: {saved}/iter_0000001 cannot be exported to Hugging Face: {REFUSED}"]
    assert _refused("ckpt", "export-hf", str(saved), str(tmp_path / "out"), "--set", "projection=mlp") == [
        "error: export-hf --set projection=mlp changes the model this checkpoint holds (projection 'affine' there): "
        "--set at export only chooses what goes beside the weights (e.g. tokenizer_path=DIR)"]
    assert not (tmp_path / "out").exists()

    big = ("plan", "--provider", "nemotron-moe-vlm-20l", "--gpu-memory", "1000")  # one rank holds it all here
    assert json.loads(_mimo(*big, "--json"))["hf_export"] == {"exportable": True, "settings": {}}
    plan = _mimo(*big, *AFFINE, "--set", "projection_norm=false", "--json")
    assert json.loads(plan)["hf_export"] == {"exportable": False, "settings": {
        "projection": {"value": "affine", "needed": "mlp"}, "projection_norm": {"value": False, "needed": True}}}
    assert note in " ".join(_mimo(*big, *AFFINE).split())  # mimo plan wraps its note to the terminal's width


def test_an_exportable_run_loads_and_generates_with_transformers_alone(tmp_path):
    saved, out = tmp_path / "run", tmp_path / "hf"
    assert "cannot be exported" not in _mimo(*RUN, "--save", str(saved))  # the defaults are the omni model's form
    killed = tmp_path / ".hf.mimo-partial-4242"  # what an export killed halfway leaves (its lock free)
    killed.mkdir()
    (killed / ".mimo-lock").touch()
    (killed / "model.safetensors").write_bytes(b"half")
    printed = _mimo("ckpt", "export-hf", str(saved), str(out))
    assert f"removed {killed}: an export that did not finish" in printed and not killed.exists()
    assert "note: RADIO has no video patch embedder" in printed  # the tiny variant's RADIO has none
    names = sorted(p.name for p in out.iterdir())
    assert names == ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                     "processor_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in out.iterdir())  # under the tests' umask 022

    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(out)
    model = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(model).__name__ == "NemotronH_Omni_Reasoning_V3"
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(images=[Image.new("RGB", (96, 64), "red")], text=text, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    # mimo's NEMOTRON rendering with its byte tokenizer: <|im_start|> 259, <img> 261, <image> 263, </img> 262
    assert ids[:6] == [259, *b"user", 10] and ids[6] == 261 and ids.count(263) == 6
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > inputs["input_ids"].shape[1]

    # The folder rules: another model's folder, the checkpoint's own directory, one of its iterations.
    for target in (out, saved, saved / "iter_0000001"):
        (line,) = _refused("ckpt", "export-hf", str(saved), str(target))
        assert "is not empty" in line or "is the checkpoint's own directory" in line, line
    assert sorted(p.name for p in out.iterdir()) == names


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("100KiB", 100 * 2**10), ("1.5MB", 1_500_000)])
def test_shard_sizes_read_as_transformers_writes_them(text, size):
    from mimo.cli.ckpt import parse_size

    assert parse_size(text) == size
