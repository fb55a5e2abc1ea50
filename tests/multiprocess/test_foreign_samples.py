"""Datasets prepared for Megatron-Bridge's chat task encoders (`ChatMLWebdataset` in `.nv-meta/dataset.yaml`) are
read as mimo's chat, with a line saying so, by training and by answers; an unknown foreign class stays one line;
a LLaVA JSON file given as `--data` names the converter."""

from __future__ import annotations

import json
import pickle
import random

import pytest

from format_datasets import COLOURS, picture, prepare, write
from helpers import read_metrics, run_mimo
from mimo.data.check import check_dataset, foreign_notes
from mimo.data.prompts import from_dataset
from mimo.errors import UsageError

BRIDGE_YAML = ("__module__: megatron.bridge.data.energon.task_encoder_utils\n__class__: ChatMLWebdataset\n"
               "field_map:\n  imgs: jpgs\n  conversation: json\nsubflavors: {}\n")


def bridge_dataset(path, samples: int = 12) -> dict:
    """Shards as Bridge's converters write them (`jpgs`: a pickled list of JPEG bytes; `json`: the turns, in
    either form), indexed by energon, with Bridge's dataset.yaml. Returns {key: (answers, number of images)}."""
    rng, rows, expected = random.Random(2), [], {}
    for i in range(samples):
        colours = [rng.choice(list(COLOURS)) for _ in range(i % 3)]
        jpegs = [picture((24 + 8 * k, 32, "RGB", "jpg"), c)[0] for k, c in enumerate(colours)]
        ask = "<image>" * len(colours) + f"Colours {i}?"
        if i % 2:
            turns = [{"from": "human", "value": ask}, {"from": "gpt", "value": " ".join(colours) or "none"}]
        else:
            turns = [{"role": "user", "content": ask}, {"role": "assistant", "content": " ".join(colours) or "none"}]
        rows.append({"__key__": f"b{i:03d}", "json": json.dumps(turns), "jpgs": pickle.dumps(jpegs)})
        expected[f"b{i:03d}"] = ([" ".join(colours) or "none"], len(colours))
    write(path, rows)
    prepare(path, "CrudeWebdataset")  # energon's index; then the yaml Bridge's converters write
    (path / ".nv-meta" / "dataset.yaml").write_text(BRIDGE_YAML)
    return expected


@pytest.fixture(scope="module")
def bridge(tmp_path_factory):
    path = tmp_path_factory.mktemp("bridge") / "chatml"
    return path, bridge_dataset(path)


def test_a_bridge_chatml_dataset_is_read_as_chat_with_a_line_saying_so(bridge):
    path, expected = bridge
    check_dataset(path)  # no refusal
    assert foreign_notes(path) == [f"--data {path}: .nv-meta/dataset.yaml names Megatron-Bridge's "
                                   f"megatron.bridge.data.energon.task_encoder_utils.ChatMLWebdataset; mimo reads it "
                                   f"as chat (conversation and imgs)"]
    prompts, without_answer = from_dataset(path, "train")
    assert without_answer == 0
    assert {p.key.split("#")[0]: ([p.reference], len(p.images)) for p in prompts} == expected


def test_mimo_run_trains_on_a_bridge_dataset(bridge, tmp_path):
    path, _ = bridge
    metrics = tmp_path / "m.jsonl"
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--data", str(path), "--train-iters", "2",
                      "--log-interval", "1", "--metrics-file", str(metrics), env={"TORCH_COMPILE_DISABLE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "names Megatron-Bridge's megatron.bridge.data.energon.task_encoder_utils.ChatMLWebdataset; mimo reads it" \
        in result.stdout
    records = [r for r in read_metrics(metrics) if r.get("split", "train") == "train"]
    assert len(records) == 2 and all(r.get("skipped_samples", 0) == 0 for r in records)


def test_an_unknown_foreign_class_stays_one_line(bridge, tmp_path):
    path, _ = bridge
    other = tmp_path / "other"
    other.mkdir()
    (other / ".nv-meta").mkdir()
    (other / ".nv-meta" / "dataset.yaml").write_text("__module__: somewhere.else\n__class__: FancyWebdataset\n")
    with pytest.raises(UsageError, match="names the sample class somewhere.else.FancyWebdataset, which cannot be "
                                         "imported here"):
        check_dataset(other)
    assert foreign_notes(other) == []


def test_a_folder_without_nv_meta_or_with_broken_yaml_is_one_line(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(UsageError, match=f"^--data {plain}: a folder without .nv-meta, not an energon dataset: "
                                         f"prepare its shards with `energon prepare {plain}`"):
        check_dataset(plain)
    (plain / ".nv-meta").mkdir()
    (plain / ".nv-meta" / "dataset.yaml").write_text("{{{: bad\n")
    with pytest.raises(UsageError) as yaml_error:
        check_dataset(plain)
    assert str(yaml_error.value) == (f"--data {plain}: {plain}/.nv-meta/dataset.yaml is not readable YAML (expected "
                                     f"the node content, but found ':' at line 1, column 4): fix it (a dataset's "
                                     f".nv-meta files: prepare it again with `energon prepare`)")
    (plain / ".nv-meta" / "dataset.yaml").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(UsageError, match=r"dataset.yaml is not readable YAML \(UnicodeDecodeError\)"):
        check_dataset(plain)
    assert foreign_notes(plain) == []


def test_a_llava_json_file_as_data_names_the_converter(tmp_path):
    llava = tmp_path / "llava.json"
    llava.write_text(json.dumps([{"id": "1", "image": "a.jpg", "conversations": []}]))
    hint = f"--data {llava}: a JSON file, not an energon dataset; LLaVA-style records"
    with pytest.raises(UsageError, match="mimo data convert llava") as refused:
        check_dataset(llava)
    assert str(refused.value).startswith(hint)
    with pytest.raises(UsageError, match="mimo data convert llava"):
        from_dataset(llava)
    result = run_mimo("run", "--provider", "mock-vlm", "--device", "cpu", "--data", str(llava), "--train-iters", "1")
    assert result.returncode == 2 and hint in result.stderr and "Traceback" not in result.stderr
