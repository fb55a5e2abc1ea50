"""Datasets of every format mimo reads, for tests: real images drawn with PIL in many sizes and modes, written with
webdataset's ShardWriter and prepared with energon's own `energon prepare` command. Each builder returns what each
sample must show the model."""

from __future__ import annotations

import io
import json

import webdataset as wds
from PIL import Image, ImageDraw

FORMATS = ("captions", "vqa", "choice", "interleaved", "sequence", "text", "chat")
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (240, 220, 30)}
# (width, height, PIL mode, file format): tiny, extreme aspect ratios, grey, alpha, palette, 16-bit, CMYK, large
LOOKS = [(1, 1, "RGB", "png"), (3, 700, "RGB", "png"), (700, 3, "L", "jpg"), (64, 48, "RGBA", "png"),
         (40, 90, "P", "png"), (90, 40, "I;16", "png"), (33, 65, "CMYK", "jpg"), (4000, 3000, "RGB", "jpg"),
         (120, 80, "LA", "png"), (48, 48, "RGB", "webp")]
# Without the 4000 x 3000 photo, whose decoding is most of a CPU training run's time on captions (about 30 s of 34
# for the 20 iterations of docs/checkpoints.md's recipes): for tests of what a recipe trains rather than of how
# images are read (test_data_formats reads and trains on every look).
QUICK_LOOKS = [look for look in LOOKS if look[0] * look[1] < 10**6]
UNICODE = "ünïcödé — 日本語"


def picture(look, colour: str) -> tuple[bytes, str, tuple[int, int]]:
    """(encoded bytes, file extension, (height, width)) of a `colour` disc drawn in `look`."""
    width, height, mode, ext = look
    image = Image.new("RGB", (width, height), (245, 245, 245))
    ImageDraw.Draw(image).ellipse((width // 4, height // 4, 3 * width // 4, 3 * height // 4), fill=COLOURS[colour])
    out = io.BytesIO()
    image.convert(mode).save(out, format={"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[ext])
    return out.getvalue(), ext, (height, width)


def prepare(path, sample_type: str, field_map: dict | None = None) -> None:
    """energon's own `energon prepare` command, non-interactively (its Python entry point: the same code)."""
    from megatron.energon.tools.prepare import command

    argv = [str(path), "--non-interactive", "--split-ratio", "1,0,0", "--sample-type", sample_type, "--no-progress",
            "--num-workers", "1"]
    command.main(argv + (["--field-map", json.dumps(field_map)] if field_map else []), standalone_mode=False)


def write(path, samples: list[dict]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(path / "shard-%04d.tar"), maxcount=6, verbose=0) as sink:
        for sample in samples:
            sink.write(sample)


def sample_loader(path, code: str) -> None:
    """`.nv-meta/sample_loader.py`, which energon prepare keeps (lists of images need one)."""
    (path / ".nv-meta").mkdir(parents=True, exist_ok=True)
    (path / ".nv-meta" / "sample_loader.py").write_text(code + "\n\ndef part_filter(part):\n    return True\n")


# Each builder writes a dataset and returns {key: expected}: `texts` that must reach the model, `answers` it is
# trained on, `prompts` it is not, and the images' (height, width) in slot order.

def build_captions(path, rng, looks=LOOKS):
    samples, expected = [], {}
    # not webp: energon's field map reads jpg and png here; chat reads webp
    for i, look in enumerate(look for look in looks if look[3] != "webp"):
        colour = rng.choice(list(COLOURS))
        data, ext, size = picture(look, colour)
        caption = f"a {colour} disc {i} {UNICODE}"
        samples.append({"__key__": f"c{i:03d}", ext: data, "txt": caption})
        expected[f"c{i:03d}"] = dict(texts=[caption], answers=[caption], prompts=[], images=[size])
    write(path, samples)
    prepare(path, "CaptioningSample", {"image": "jpg,png", "caption": "txt"})
    return expected


def build_vqa(path, rng):
    samples, expected = [], {}
    for i in range(8):
        colour = rng.choice(list(COLOURS))
        data, ext, size = picture(LOOKS[i % 7], colour)
        before, after = f"Question {i}: in", "what colour is the disc?"
        question = f"{before} <image> {after}" if i % 2 else f"{before} {after}"
        best = [colour, "grey"] if i % 3 else ["grey", colour]  # the answer with the highest weight is trained
        qa = {"q": question, "answers": best, "weights": [0.7, 0.3] if i % 3 else [0.3, 0.7]}
        samples.append({"__key__": f"v{i:03d}", ext: data, "json": qa})
        expected[f"v{i:03d}"] = dict(texts=[before, after, colour], answers=[colour], prompts=[after], images=[size])
    write(path, samples)
    prepare(path, "VQASample", {"image": "jpg,png", "context": "json[q]", "answers": "json[answers]",
                                "answer_weights": "json[weights]"})
    return expected


def build_choice(path, rng):
    samples, expected = [], {}
    for i in range(6):
        colour = rng.choice(list(COLOURS))
        data, ext, size = picture(LOOKS[3], colour)
        choices = [f"{c} ({UNICODE})" for c in COLOURS]
        q = {"q": f"Pick the colour {i}.", "choices": choices, "answer": list(COLOURS).index(colour)}
        samples.append({"__key__": f"m{i:03d}", ext: data, "json": q})
        expected[f"m{i:03d}"] = dict(texts=[q["q"], *choices], answers=[choices[q["answer"]]],
                                     prompts=[q["q"]], images=[size])
    write(path, samples)
    prepare(path, "MultiChoiceVQASample", {"image": "png", "context": "json[q]", "choices": "json[choices]",
                                           "correct_choice_idx": "json[answer]"})
    return expected


def build_interleaved(path, rng):
    samples, expected = [], {}
    for i in range(6):
        texts = [f"Paragraph {j} of document {i} {UNICODE}." for j in range(2 + i % 3)]
        n = 1 + i % 3
        pictures = [picture(LOOKS[(i + k) % 7], rng.choice(list(COLOURS))) for k in range(n)]
        matched = [rng.randrange(len(texts)) for _ in range(n)]
        names = [f"{k}.{ext}" for k, (_, ext, _) in enumerate(pictures)]
        samples.append({"__key__": f"i{i:03d}", "json": {"texts": texts, "images": names, "matched": matched},
                        **{name: data for name, (data, _, _) in zip(names, pictures)}})
        order = sorted(range(n), key=lambda k: (matched[k], k))  # each image before its text
        expected[f"i{i:03d}"] = dict(texts=texts, answers=texts, prompts=[],
                                     images=[pictures[k][2] for k in order])
    write(path, samples)
    sample_loader(path, "def sample_loader(raw):\n    doc = raw['json']\n"
                        "    return dict(images=[raw[n] for n in doc['images']], texts=doc['texts'],\n"
                        "                matched_text_indices=doc['matched'])")
    prepare(path, "SimilarityInterleavedSample")
    return expected


def build_sequence(path, rng):
    samples, expected = [], {}
    for i in range(6):
        data, ext, size = picture(LOOKS[i % 7], rng.choice(list(COLOURS)))
        words = [f"Before {i},", f"after {i} {UNICODE}."]
        samples.append({"__key__": f"s{i:03d}", f"0.{ext}": data, "json": [words[0], f"0.{ext}", words[1]]})
        expected[f"s{i:03d}"] = dict(texts=words, answers=words, prompts=[], images=[size])
    write(path, samples)
    sample_loader(path, "def sample_loader(raw):\n"
                        "    return dict(sequence=[raw[p] if p in raw and p != 'json' else p for p in raw['json']])")
    prepare(path, "InterleavedSample")
    return expected


def build_text(path, rng):
    texts = {f"t{i:03d}": f"Plain text number {i}: {UNICODE} {rng.random():.4f}" for i in range(6)}
    write(path, [{"__key__": key, "txt": text} for key, text in texts.items()])
    prepare(path, "TextSample", {"text": "txt"})
    return {key: dict(texts=[t], answers=[t], prompts=[], images=[]) for key, t in texts.items()}


def chat_record(i: int, rng) -> tuple[dict, dict, dict]:
    """(the chat's parts, its JSON, the expected) for chat sample `i`: both JSON forms, a system turn, 0 to 3
    images with placeholders anywhere (or none in the text), a text-only sample."""
    colours = [rng.choice(list(COLOURS)) for _ in range(3)]
    if i % 4 == 0:  # LLaVA, one image, a system field
        chat = {"system": f"System note {i}.", "conversations": [
            {"from": "human", "value": f"<image>\nWhat colour, {i}?"}, {"from": "gpt", "value": f"{colours[0]}."},
            {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": f"Yes {UNICODE}."}]}
        looks = [LOOKS[i % 7]]
    elif i % 4 == 1:  # messages, three images named in the JSON, placeholders in the second user turn
        chat = {"messages": [
            {"role": "user", "content": [{"type": "text", "text": f"Three pictures {i}."}]},
            {"role": "assistant", "content": "Show me."},
            {"role": "user", "content": "First <image>, then <image> and <image>: colours?"},
            {"role": "assistant", "content": " ".join(colours)}]}
        looks = [LOOKS[(i + k) % 7] for k in range(3)]
    elif i % 4 == 2:  # images but no placeholder: they go first
        chat = {"conversations": [{"from": "human", "value": f"Describe {i}."},
                                  {"from": "gpt", "value": f"Two discs: {colours[0]}, {colours[1]}."}]}
        looks = [LOOKS[3], LOOKS[9]]
    else:  # text only
        chat = {"messages": [{"role": "system", "content": "Plain."}, {"role": "user", "content": f"Count {i}."},
                             {"role": "assistant", "content": f"{i} {UNICODE}"}]}
        looks = []
    pictures = [picture(look, colour) for look, colour in zip(looks, colours)]
    names = [f"img{k}.{ext}" if len(pictures) > 1 else ext for k, (_, ext, _) in enumerate(pictures)]
    if i % 4 == 1:
        names = [f"img{k}.{ext}" for k, (_, ext, _) in zip((10, 2, 1), pictures)]  # natural order would differ
        chat["images"] = names
    messages = chat.get("conversations") or chat["messages"]
    said = [m.get("value", m.get("content")) for m in messages]
    said = [s if isinstance(s, str) else s[0]["text"] for s in said]
    roles = [m.get("from", m.get("role")) for m in messages]
    answers = [s for s, r in zip(said, roles) if r in ("gpt", "assistant")]
    prompts = [s for s, r in zip(said, roles) if r in ("human", "user", "system")] + [chat.get("system", "")]
    pieces = [p for s in said + [chat.get("system", "")] for p in s.split("<image>") if p.strip()]
    expected = dict(texts=pieces, answers=answers, prompts=[p for p in prompts if p and "<image>" not in p],
                    images=[size for _, _, size in pictures], chat=chat)
    return {name: data for name, (data, _, _) in zip(names, pictures)}, chat, expected


def build_chat(path, rng):
    samples, expected = [], {}
    for i in range(12):
        parts, chat, expected[f"h{i:03d}"] = chat_record(i, rng)
        samples.append({"__key__": f"h{i:03d}", "json": chat, **parts})
    write(path, samples)
    prepare(path, "CrudeWebdataset")
    return expected


BUILDERS = {"captions": build_captions, "vqa": build_vqa, "choice": build_choice, "interleaved": build_interleaved,
            "sequence": build_sequence, "text": build_text, "chat": build_chat}
assert tuple(BUILDERS) == FORMATS


# LLaVA-style records for `mimo data convert llava`: one image, two images placed inside the text, text only (with a
# system string); the images' (width, height) by name.
LLAVA_SIZES = {"a.jpg": (64, 48), "b.png": (40, 90), "c.jpg": (120, 80)}


def write_llava(root) -> list[dict]:
    """The images and `llava.json` under `root` (images in `root / "images"`); the records written, in order."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    for name, size in LLAVA_SIZES.items():
        Image.new("RGB", size, (200, 40, 40)).save(root / "images" / name)
    records = []
    for i in range(6):
        if i % 3 == 0:
            records.append({"id": f"one{i}", "image": "a.jpg", "conversations": [
                {"from": "human", "value": "<image>\nWhat is shown?"}, {"from": "gpt", "value": f"A red box {i}."}]})
        elif i % 3 == 1:
            records.append({"id": f"two{i}", "image": ["b.png", "c.jpg"], "conversations": [
                {"from": "human", "value": "Compare <image> with <image>."},
                {"from": "gpt", "value": "The first is taller."}, {"from": "human", "value": "Sure?"},
                {"from": "gpt", "value": "Yes."}]})
        else:
            records.append({"id": f"text{i}", "system": "Be brief.", "conversations": [
                {"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}]})
    (root / "llava.json").write_text(json.dumps(records))
    return records
