"""Answers (`mimo generate --data`, `--eval-samples`) read every dataset kind training reads: captions, VQA,
multiple choice, crude chat through the cooker (as `mimo data convert llava` writes it), interleaved documents and
plain text (continued from their beginning), and a blend of them; on the converter's own output through the CLI."""

from __future__ import annotations

import json
import random

import pytest

from format_datasets import BUILDERS, FORMATS, picture
from helpers import read_metrics, run_mimo
from mimo.data import ByteTokenizer, PLAIN, Turn
from mimo.data.images import to_float_image
from mimo.data.prompts import Prompt, from_dataset

ANSWERED = ("captions", "vqa", "choice", "chat")  # formats with answer turns; the others are documents


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("answer-formats")
    rng = random.Random(11)
    return root, {name: BUILDERS[name](root / name, rng) for name in FORMATS}


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_gives_prompts_with_its_references_and_images(datasets, name):
    root, expected = datasets
    prompts, without_answer = from_dataset(root / name, "train")  # the builders write a train split only
    assert without_answer == 0
    by_sample: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_sample.setdefault(prompt.key.split("#")[0], []).append(prompt)
    assert set(by_sample) == set(expected[name])
    for key, found in by_sample.items():
        want = expected[name][key]
        if name in ANSWERED:  # one prompt per answer turn, the dataset's answer its reference
            # a multiple choice is answered with its letter and the choice
            assert len(found) == len(want["answers"]), key
            assert all(p.reference.endswith(a) for p, a in zip(found, want["answers"])), key
            assert all(p.turns[-1].role in ("user", "assistant", "system") for p in found)
        else:  # a document: its beginning, the rest of its text the reference
            (prompt,) = found
            whole = " ".join(want["texts"])
            assert prompt.reference and prompt.reference in whole and not whole.startswith(prompt.reference), key
            assert prompt.turns[-1].role == "document"
        assert len(found[-1].images) <= len(want["images"])
        for prompt in found:
            sizes = [tuple(to_float_image(im).shape[-2:]) for im in prompt.images]
            assert sizes == [tuple(s) for s in want["images"][:len(sizes)]], key


def test_a_blend_of_every_format_gives_prompts_from_each(datasets):
    root, expected = datasets
    blend = "".join(f"      - weight: 1\n        path: {name}\n" for name in FORMATS)
    (root / "blend.yaml").write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n"
                                     "    blend:\n" + blend)
    prompts, _ = from_dataset(root / "blend.yaml", "train")
    keys = {p.key.split("#")[0] for p in prompts}
    assert all(set(expected[name]) <= keys for name in FORMATS)
    again, _ = from_dataset(root / "blend.yaml", "train", limit=7)
    assert [p.key for p in again] == [p.key for p in prompts[:7]]  # the stored order, every time


def test_a_document_is_continued_without_its_end_or_an_answer_header():
    from mimo.data.conversation import IMAGE

    tok = ByteTokenizer(vocab_size=512)
    turns = [Turn("document", ("Before the picture ", IMAGE, " and after it"))]
    continued = PLAIN.generation_prompt(turns, [3], tok)
    assert continued == PLAIN.render(turns, [3], tok).tokens[:-1] and continued[-1] != tok.eos_id
    answered = PLAIN.generation_prompt([Turn("user", ("Hi",))], [], tok)
    assert answered == PLAIN.render([Turn("user", ("Hi",))], [], tok).tokens  # PLAIN has no header to add


def _llava(root, records: int = 16):
    rng, out = random.Random(5), []
    (root / "images").mkdir(parents=True)
    for i in range(records):
        colour = rng.choice(["red", "green", "blue"])
        data, ext, _ = picture((40, 32, "RGB", "jpg"), colour)
        (root / "images" / f"{i}.{ext}").write_bytes(data)
        out.append({"id": f"r{i}", "image": f"{i}.{ext}", "conversations": [
            {"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": colour}]})
    (root / "llava.json").write_text(json.dumps(out))


def test_answers_on_the_converters_output_through_run_and_generate(tmp_path):
    """The chat dataset `mimo data convert llava` writes: `--eval-samples` in `mimo run`, then `mimo generate
    --load CK --data DS` on its val split."""
    from mimo.data.convert.llava import convert_llava

    _llava(tmp_path)
    data = tmp_path / "ds"
    convert_llava(tmp_path / "llava.json", tmp_path / "images", data, val_fraction=0.5, say=lambda line: None)
    env = {"TORCH_COMPILE_DISABLE": "1"}
    metrics = tmp_path / "m.jsonl"
    run = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--data", str(data), "--train-iters", "2",
                   "--eval-iters", "1", "--eval-interval", "2", "--eval-samples", "2", "--set", "seq_length=96",
                   "--save", str(tmp_path / "ck"), "--metrics-file", str(metrics), env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "predictions (val) at iteration 2" in run.stdout + run.stderr
    answers = tmp_path / "answers.jsonl"
    gen = run_mimo("generate", "--load", str(tmp_path / "ck"), "--device", "cpu", "--data", str(data), "--limit",
                   "3", "--max-new-tokens", "4", "--output", str(answers), env=env)
    assert gen.returncode == 0, gen.stderr[-3000:]
    records = read_metrics(answers)
    assert len(records) == 3 and all(r["reference"] in ("red", "green", "blue") for r in records)
    assert f"mimo generate: 3 answers to {data} (val)" in gen.stderr
