"""The records of bench/real_shaped_data.py's dataset, and their images: LLaVA-style chats drawn from a seed.

Each record is drawn from the seed and its index alone (`plan_record`), each image from the seed and its name
(`draw`): the first N records of a larger set are the same, and any number of processes write the same files.

- images: small crops (96-320 px; 60% JPEG photos, 40% PNG graphics) 22%, photos (long side 640-1600, 4:3, 3:2,
  1:1 or 16:9, a quarter portrait; JPEG) 50%, 1920x1080 frames (JPEG) 10%, phone screenshots (1170x2532 or
  1080x2400; two thirds PNG, a third JPEG) 12%, wide panoramas (2000-3200 wide, 2.5-4:1; JPEG) 6%. A photo is a
  noisy colour gradient tiled from a random offset under 3-10 flat shapes, JPEG quality 80-92: about 0.9 bits per
  pixel (a real photo at a lower quality), so that its bytes and its decoding cost what a photo's do. Screenshots
  and PNG crops are flat UI (a header, bars of "text", cards), as PNG keeps them.
- records: 10% text-only (no `image`), 10% with two images, the rest one; 1-5 rounds of human/gpt turns (40% one
  round); `<image>` where LLaVA puts it: on its own line before the first question (a fifth after it); of two
  images, both before it, or labelled ("Image 1: <image>"), or the second before the second question.
- text: words drawn by a Zipf law from a fixed vocabulary (common English function words and 3000 pseudo-words of
  1-4 syllables; about 6 bytes a word with its space, as English), in sentences; questions 3-30 words (median 9);
  answers lognormal, median 32 words (most 10-100, p99 about 230, up to several hundred).
"""

from __future__ import annotations

import io
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

# (size class, share of images); the shapes drawn for each are in `image_spec`
SIZE_CLASSES = (("crop", 0.22), ("photo", 0.50), ("frame", 0.10), ("screenshot", 0.12), ("panorama", 0.06))
IMAGES_PER_RECORD = ((0, 0.10), (1, 0.80), (2, 0.10))
ROUNDS = ((1, 0.40), (2, 0.22), (3, 0.16), (4, 0.12), (5, 0.10))
PHOTO_SIDES = ((640, 0.35), (800, 0.20), (1024, 0.20), (1280, 0.15), (1600, 0.10))  # long side
PHOTO_ASPECTS = ((4 / 3, 0.55), (3 / 2, 0.25), (1.0, 0.10), (16 / 9, 0.10))
PHONES = ((1170, 2532), (1080, 2400))
ANSWER_WORDS = (32, 0.85, 2, 1200)  # lognormal median, sigma, clipped to [low, high]
QUESTION_WORDS = (9, 0.45, 3, 30)
TEXTURES, TEXTURE_SIDE = 16, 1024

FUNCTION_WORDS = ("the of and a to in is that it for on with as are this be at by from or an which can its "
                  "there these has not also one two more into than their other".split())


def _vocabulary() -> tuple[list[str], list[float]]:
    """Fixed (not from --seed): function words first, then 3000 pseudo-words; Zipf weights by rank."""
    rng = random.Random("real-shaped vocabulary")
    onsets, vowels = "b c d f g h k l m n p r s t v w z br st tr pl gr ch sh th".split(), "a e i o u ai ea ou".split()
    words, seen = list(FUNCTION_WORDS), set(FUNCTION_WORDS)
    while len(words) < 3000 + len(FUNCTION_WORDS):
        word = "".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4))))
        word += rng.choice(("", "", "n", "s", "r", "t", "l"))
        if word not in seen:
            seen.add(word)
            words.append(word)
    cumulative, total = [], 0.0
    for rank in range(len(words)):
        total += 1 / (rank + 2) ** 1.05
        cumulative.append(total)
    return words, cumulative


VOCABULARY, CUMULATIVE = _vocabulary()


def pick(rng: random.Random, table):
    return rng.choices([value for value, _ in table], weights=[weight for _, weight in table])[0]


def lognormal_count(rng: random.Random, shape) -> int:
    median, sigma, low, high = shape
    return min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))


def text(rng: random.Random, count: int, end: str = ".") -> str:
    """`count` words in sentences of 5-20 (some with a comma); answers over 60 words also in paragraphs."""
    words = rng.choices(VOCABULARY, cum_weights=CUMULATIVE, k=count)
    out, start = "", 0
    while start < count:
        stop = min(count, start + rng.randint(5, 20))
        sentence = words[start:stop]
        if len(sentence) > 8 and rng.random() < 0.5:
            sentence[rng.randrange(3, len(sentence) - 3)] += ","
        if start:
            out += "\n\n" if count > 60 and rng.random() < 0.2 else " "
        sentence = " ".join(sentence)
        out += sentence[:1].upper() + sentence[1:] + (end if stop == count else ".")
        start = stop
    return out


@dataclass(frozen=True)
class ImageSpec:
    name: str  # relative to the image folder
    kind: str  # size class
    width: int
    height: int
    format: str  # JPEG or PNG
    quality: int = 0  # JPEG's


def image_spec(rng: random.Random, name: str) -> ImageSpec:
    kind = pick(rng, SIZE_CLASSES)
    if kind == "crop":
        width, height = rng.randint(96, 320), rng.randint(96, 320)
        fmt = "PNG" if rng.random() < 0.4 else "JPEG"
    elif kind == "photo":
        long, aspect = pick(rng, PHOTO_SIDES), pick(rng, PHOTO_ASPECTS)
        width, height = long, round(long / aspect)
        if aspect != 1 and rng.random() < 0.25:
            width, height = height, width
        fmt = "JPEG"
    elif kind == "frame":
        width, height, fmt = 1920, 1080, "JPEG"
    elif kind == "screenshot":
        width, height = rng.choice(PHONES)
        fmt = "PNG" if rng.random() < 2 / 3 else "JPEG"
    else:
        width = rng.randrange(2000, 3201, 100)
        width, height, fmt = width, round(width / rng.uniform(2.5, 4.0)), "JPEG"
    ext = "png" if fmt == "PNG" else "jpg"
    return ImageSpec(f"{kind}/{name}.{ext}", kind, width, height, fmt, rng.randint(80, 92) if fmt == "JPEG" else 0)


def plan_record(seed: int, index: int) -> tuple[dict, list[ImageSpec]]:
    """Record `index` of the dataset of `seed` (LLaVA's form) and its images, without drawing them."""
    rng = random.Random(f"real-shaped {seed} {index}")
    n_images, rounds = pick(rng, IMAGES_PER_RECORD), pick(rng, ROUNDS)
    images = [image_spec(rng, f"{index:06d}" + (f"-{k}" if n_images > 1 else "")) for k in range(n_images)]
    questions = [text(rng, lognormal_count(rng, QUESTION_WORDS), "?") for _ in range(rounds)]
    answers = [text(rng, lognormal_count(rng, ANSWER_WORDS)) for _ in range(rounds)]
    if n_images == 1:
        questions[0] = "<image>\n" + questions[0] if rng.random() < 0.8 else questions[0] + "\n<image>"
    elif n_images == 2:
        where = rng.random()
        if where < 0.25 and rounds > 1:  # the second image comes with the second question
            questions[0], questions[1] = "<image>\n" + questions[0], "<image>\n" + questions[1]
        elif where < 0.5:
            questions[0] = "Image 1: <image>\nImage 2: <image>\n" + questions[0]
        else:
            questions[0] = "<image>\n<image>\n" + questions[0]
    turns = [turn for q, a in zip(questions, answers) for turn in ({"from": "human", "value": q},
                                                                     {"from": "gpt", "value": a})]
    record = {"id": f"rs{seed}-{index:06d}"}
    if images:
        record["image"] = images[0].name if n_images == 1 else [image.name for image in images]
    record["conversations"] = turns
    return record, images


# -- pixels --------------------------------------------------------------------------------------------------------

def textures(seed: int) -> list:
    """Photo backgrounds, made once per dataset: colour bands (a coarse gradient) under sensor-like noise. A photo
    is a tiling of one at a random offset (copies, not per-pixel arithmetic: the writer's time goes to encoding)."""
    import numpy as np
    from PIL import Image, ImageChops, ImageDraw

    rng, out = random.Random(f"real-shaped textures {seed}"), []
    noise = np.random.default_rng(seed).normal(64, 5, (TEXTURE_SIDE, TEXTURE_SIDE, 3)).clip(0, 128).astype(np.uint8)
    for _ in range(TEXTURES):
        grain = np.roll(noise, (rng.randrange(TEXTURE_SIDE), rng.randrange(TEXTURE_SIDE)), axis=(0, 1))
        image = Image.new("RGB", (TEXTURE_SIDE, TEXTURE_SIDE))
        draw = ImageDraw.Draw(image)
        top, bottom, bands = colour(rng), colour(rng), 32
        for i in range(bands):
            f = i / (bands - 1)
            draw.rectangle((0, TEXTURE_SIDE * i // bands, TEXTURE_SIDE, TEXTURE_SIDE * (i + 1) // bands),
                           fill=tuple(round(a * (1 - f) + b * f) for a, b in zip(top, bottom)))
        out.append(ImageChops.add(image, Image.fromarray(grain), 1.0, -64))
    return out


def colour(rng: random.Random, low: int = 0, high: int = 255) -> tuple[int, int, int]:
    return tuple(rng.randint(low, high) for _ in range(3))


def photo(rng: random.Random, width: int, height: int, backgrounds: list):
    """A background tiled from a random offset, then 3-10 flat shapes: what costs a JPEG photo's bytes and
    decoding (about 1 bit per pixel at the qualities drawn)."""
    from PIL import Image, ImageDraw

    image, texture = Image.new("RGB", (width, height)), rng.choice(backgrounds)
    ox, oy = rng.randrange(TEXTURE_SIDE), rng.randrange(TEXTURE_SIDE)
    for y in range(-oy, height, TEXTURE_SIDE):
        for x in range(-ox, width, TEXTURE_SIDE):
            image.paste(texture, (x, y))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(3, 10)):
        x, y = rng.randrange(width), rng.randrange(height)
        a, b = rng.randint(width // 20 + 1, width // 5 + 1), rng.randint(height // 20 + 1, height // 5 + 1)
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x - a, y - b, x + a, y + b), fill=colour(rng))
    return image


def interface(rng: random.Random, width: int, height: int):
    """A flat UI: a header, lines of word-like bars, cards; what a screenshot or a diagram crop looks like."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), colour(rng, 200))
    draw = ImageDraw.Draw(image)
    unit = max(4, width // 60)  # a text line's height
    y = rng.randint(2, 3) * unit
    draw.rectangle((0, 0, width, y), fill=colour(rng))
    y += unit
    while y < height:
        if rng.random() < 0.75:  # a line of text
            x, ink = 2 * unit, (rng.randrange(90),) * 3
            while x < width - 3 * unit:
                word = rng.randint(unit, 6 * unit)
                draw.rectangle((x, y, min(x + word, width - 2 * unit), y + unit), fill=ink)
                x += word + unit // 2 + 1
            y += 2 * unit
        else:  # a card
            h = rng.randint(4, 16) * unit
            draw.rounded_rectangle((unit, y, width - unit, y + h), radius=unit, fill=colour(rng))
            y += h + unit
    return image


def draw(spec: ImageSpec, seed: int, backgrounds: list) -> bytes:
    rng = random.Random(f"real-shaped pixels {seed} {spec.name}")
    flat = spec.kind == "screenshot" or (spec.kind == "crop" and spec.format == "PNG")
    image = interface(rng, spec.width, spec.height) if flat else photo(rng, spec.width, spec.height, backgrounds)
    out = io.BytesIO()
    if spec.format == "PNG":
        image.save(out, format="PNG", compress_level=1)  # zlib's fastest: what screenshot tools write
    else:
        image.save(out, format="JPEG", quality=spec.quality)
    return out.getvalue()


_BACKGROUNDS: dict = {}  # seed -> textures, once per process


def write_images(folder: Path, seed: int, specs: list[ImageSpec]) -> None:
    backgrounds = _BACKGROUNDS.setdefault(seed, textures(seed)) if specs else None
    for spec in specs:
        (folder / "images" / spec.name).write_bytes(draw(spec, seed, backgrounds))


def write_source(folder: Path, records: int, seed: int, workers: int = 1) -> list[tuple[dict, list[ImageSpec]]]:
    """`llava.json` and `images/` under `folder`; the records and their images' specs. Every image depends on the
    seed and its name alone, so `workers` processes write the same files as one."""
    plans = [plan_record(seed, i) for i in range(records)]
    for kind, _ in SIZE_CLASSES:
        (folder / "images" / kind).mkdir(parents=True, exist_ok=True)
    specs = [spec for _, record_specs in plans for spec in record_specs]
    if workers > 1:
        import functools
        import multiprocessing

        chunks = [specs[i::workers * 4] for i in range(workers * 4)]  # interleaved: big images spread evenly
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            pool.map(functools.partial(write_images, folder, seed), chunks)
    else:
        write_images(folder, seed, specs)
    (folder / "llava.json").write_text(json.dumps([record for record, _ in plans], ensure_ascii=False))
    return plans
