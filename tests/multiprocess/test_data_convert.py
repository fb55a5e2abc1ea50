"""`mimo data convert llava`: a streaming JSON reader, then a few hundred LLaVA records with photo-like images (some
bad) converted, trained on (`mimo run --data OUT`) and evaluated (`mimo eval`, the val split)."""

from __future__ import annotations

import json
import random
import tarfile

import pytest

from helpers import run_mimo
from mimo.data.convert.json_stream import JSONSyntaxError, records
from mimo.data.convert.llava import sample_of

NUM_RECORDS = 240
BAD = {7: "missing", 13: "undecodable", 21: "placeholders", 44: "role"}  # index % 50 -> what is wrong


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_the_json_stream_reads_what_json_loads_reads(tmp_path, chunk):
    values = [{"id": i, "text": "ünï [1, 2] {\"x\": \"]\"}" * (i % 3), "n": [i, None, True]} for i in range(25)]
    array, lines = tmp_path / "a.json", tmp_path / "a.jsonl"
    array.write_text(json.dumps(values, indent=1))
    lines.write_text("\n".join(json.dumps(v) for v in values) + "\n")
    for path in (array, lines):
        got = list(records(path, chunk=chunk))
        assert [v for _, _, v in got] == values and [i for i, _, _ in got] == list(range(25))
        text = path.read_text()
        assert all(text[offset] == "{" for _, offset, _ in got)  # character offsets into the file
    broken = tmp_path / "b.json"
    broken.write_text('[{"a": 1}, {"a": nope}]')
    with pytest.raises(JSONSyntaxError, match=r"^not valid JSON: Expecting value at line 1, column 18 \(character "
                                              r"17\)$"):
        list(records(broken, chunk=chunk))
    # json's own message whole ("... starting at" a place), on the line and column an editor shows
    broken.write_text('[\n {"id": 1, "a": "x"},\n {"id": 2, "a": "y}\n]\n')
    with pytest.raises(JSONSyntaxError, match=r"^not valid JSON: Invalid control character at line 3, column 20 "
                                              r"\(character 43\)$"):
        list(records(broken, chunk=chunk))
    broken.write_text('[\n {"id": 1, "a": "x"},\n {"id": 2, "a": "y')
    with pytest.raises(JSONSyntaxError, match=r"^not valid JSON: Unterminated string starting at line 3, column 17 "
                                              r"\(character 40\)$"):
        list(records(broken, chunk=chunk))
    broken.write_text('[{"a": 1}, {"a": 2}')
    with pytest.raises(JSONSyntaxError, match=r"the array is not closed \(the file ends at line 1, column 20 "):
        list(records(broken, chunk=chunk))
    broken.write_bytes('{"a": "ü"}\n{"a": "\xff"}\n'.encode("utf-8").replace(b"\xc3\xbf", b"\xff"))  # latin-1 ÿ
    with pytest.raises(JSONSyntaxError, match=r"^not UTF-8 text at line 2 \(byte 19: invalid start byte\); JSON is "
                                              r"UTF-8: re-encode the file"):
        list(records(broken, chunk=chunk))


def test_a_record_without_a_chat_names_its_own_keys(tmp_path):
    with pytest.raises(ValueError, match=r"neither 'conversations' \(from/value\) nor 'messages' \(role/content\); "
                                         r"its keys: \['id', 'image'\]"):
        sample_of({"id": "1", "image": "a.jpg"}, tmp_path)


def photo(rng, path):
    """A photo-like image: a colour gradient, shapes, noise and blur, as JPEG (PNG for some)."""
    from PIL import Image, ImageDraw, ImageFilter

    w, h = rng.randint(160, 480), rng.randint(120, 360)
    base = Image.linear_gradient("L").resize((w, h)).convert("RGB")
    tint = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
    image = Image.blend(base, tint, 0.6)
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x, y = rng.randrange(w), rng.randrange(h)
        draw.ellipse((x, y, x + rng.randint(10, 90), y + rng.randint(10, 90)),
                     fill=tuple(rng.randrange(256) for _ in range(3)))
    noise = Image.effect_noise((w, h), 40).convert("RGB")
    Image.blend(image, noise, 0.15).filter(ImageFilter.GaussianBlur(1.5)).save(path)


def write_llava(root) -> list[dict]:
    rng = random.Random(0)
    (root / "images" / "sub").mkdir(parents=True)
    out = []
    for i in range(NUM_RECORDS):
        name = f"sub/{i:06d}." + ("png" if i % 10 == 0 else "jpg")
        photo(rng, root / "images" / name)
        conv = [{"from": "human", "value": "<image>\nWhat is shown?"},
                {"from": "gpt", "value": f"Round shapes, picture {i}."}]
        record = {"id": f"rec.{i}/x", "image": name, "conversations": conv}
        kind = BAD.get(i % 50)
        if kind == "missing":
            record["image"] = f"sub/missing{i}.jpg"
        elif kind == "undecodable":
            (root / "images" / name).write_bytes(b"\xff\xd8\xff" + bytes(100))
        elif kind == "placeholders":
            conv[0]["value"] = "<image> and <image>?"
        elif kind == "role":
            conv[1]["from"] = "narrator"
        elif i % 50 == 33:  # text only
            record = {"id": f"rec.{i}/x", "conversations": [{"from": "human", "value": "Hi?"},
                                                             {"from": "gpt", "value": "Hello."}]}
        elif i % 50 == 41:  # two images, the placeholders inside the text
            record["image"] = [name, f"sub/{i + 1:06d}.jpg"]
            conv[0]["value"] = "Compare <image> with <image>, please."
        out.append(record)
    (root / "llava.json").write_text(json.dumps(out, indent=1))
    return out


def test_convert_llava_then_train_and_evaluate(tmp_path):
    source = write_llava(tmp_path / "src")
    out = tmp_path / "ds"
    result = run_mimo("data", "convert", "llava", str(tmp_path / "src" / "llava.json"), str(tmp_path / "src" / "images"),
                      str(out), "--val-fraction", "0.1", "--shard-size", "100")
    assert result.returncode == 0 and result.stderr == "", result.stderr[-3000:]
    bad = sorted(i for i in range(NUM_RECORDS) if i % 50 in BAD)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == len(bad) + 1 and all(line.startswith("skipped record ") for line in lines[:-1])
    assert lines[0].startswith("skipped record 7 (id 'rec.7/x', character ") and "missing7.jpg" in lines[0]
    assert "cannot be decoded" in lines[1] and "placeholders but the sample has 1 image" in lines[2]
    assert "unknown role 'narrator'" in lines[3]
    summary = lines[-1]
    assert summary.startswith(f"converted {NUM_RECORDS - len(bad)} of {NUM_RECORDS} records into {out}: ")
    assert summary.endswith(f", {len(bad)} skipped (records {', '.join(map(str, bad[:10]))}, ...)")
    train, val = (int(summary.split(f" {s}")[0].split()[-1]) for s in ("train,", "val,"))
    assert train + val == NUM_RECORDS - len(bad) and 5 < val < 50
    assert (out / ".nv-meta" / "dataset.yaml").read_text().endswith("__class__: CrudeWebdataset\n")
    assert not list(tmp_path.glob(".ds.mimo-partial-*"))
    with tarfile.open(sorted(out.glob("train-*.tar"))[0]) as tar:  # the text is kept as it stands
        parts = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    two = json.loads(parts["000000041.json"])
    assert two["conversations"][0]["value"] == "Compare <image> with <image>, please."
    assert two["images"] == ["0.jpg", "1.jpg"] and two["id"] == source[41]["id"]
    assert "000000041.0.jpg" in parts and "000000040.png" in parts

    common = ("--provider", "nemotron-moe-vlm-tiny", "--device", "cpu", "--data", str(out), "--num-workers", "1")
    trained = run_mimo("run", *common, "--train-iters", "4", "--log-interval", "2", "--save", str(tmp_path / "s"))
    assert trained.returncode == 0 and trained.stderr == "", trained.stderr[-3000:]
    assert "skipped samples" not in trained.stdout and "cut by seq_length" not in trained.stdout  # all fit
    evaluated = run_mimo("eval", *common, "--load", str(tmp_path / "s"), "--eval-iters", "2")
    assert evaluated.returncode == 0 and evaluated.stderr == "", evaluated.stderr[-3000:]
    assert "validation (val) at iteration 4" in evaluated.stdout


def test_convert_llava_without_a_val_split_prepares_the_train_split_alone(tmp_path):
    """No --val-fraction: no val shard is left behind (an empty one stopped energon's preparation)."""
    from PIL import Image

    from mimo.data.convert.llava import convert_llava

    (tmp_path / "images").mkdir()
    records = []
    for i in range(3):
        Image.new("RGB", (32, 24), (10 * i, 0, 0)).save(tmp_path / "images" / f"{i}.png")
        records.append({"id": str(i), "image": f"{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": f"Red {i}."}]})
    (tmp_path / "llava.json").write_text(json.dumps(records))
    convert_llava(tmp_path / "llava.json", tmp_path / "images", tmp_path / "ds", shard_size=2)
    assert sorted(p.name for p in (tmp_path / "ds").glob("*.tar")) == ["train-000000.tar", "train-000001.tar"]
    assert (tmp_path / "ds" / ".nv-meta" / "dataset.yaml").exists()


def test_a_converted_llava_dataset_trains_evaluates_and_answers_on_the_qwen_vlm(tmp_path):
    """qwen3.5-vl-tiny reads what `mimo data convert llava` writes: images through the processor's grid, 3-D
    positions per packed sample; `mimo eval` on its val split, `mimo generate --data` answers its questions."""
    write_llava(tmp_path / "src")
    out = tmp_path / "ds"
    converted = run_mimo("data", "convert", "llava", str(tmp_path / "src" / "llava.json"),
                         str(tmp_path / "src" / "images"), str(out), "--val-fraction", "0.1")
    assert converted.returncode == 0, converted.stderr[-3000:]
    common = ("--provider", "qwen3.5-vl-tiny", "--device", "cpu", "--data", str(out), "--num-workers", "1")
    trained = run_mimo("run", *common, "--train-iters", "4", "--log-interval", "2", "--save", str(tmp_path / "s"))
    assert trained.returncode == 0 and trained.stderr == "", trained.stderr[-3000:]
    assert "skipped samples" not in trained.stdout and "cut by seq_length" not in trained.stdout  # all fit
    evaluated = run_mimo("eval", *common, "--load", str(tmp_path / "s"), "--eval-iters", "2")
    assert evaluated.returncode == 0 and "validation (val) at iteration 4" in evaluated.stdout, evaluated.stderr
    answered = run_mimo("generate", *common[:4], "--data", str(out), "--load", str(tmp_path / "s"), "--limit", "2",
                        "--max-new-tokens", "4")
    assert answered.returncode == 0, answered.stderr[-3000:]
    answers = [json.loads(line) for line in answered.stdout.splitlines() if line.startswith("{")]
    assert len(answers) == 2 and all(a["prompt"].startswith("<image>") and a["answer_tokens"] == 4 for a in answers)
