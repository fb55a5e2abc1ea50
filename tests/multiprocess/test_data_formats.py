"""Every accepted data format reaches the model, for the built-in providers: datasets of real images (drawn with
PIL in many sizes and modes) written with webdataset's ShardWriter and prepared with energon's own `energon prepare`
command; every text field in the micro-batch, each image's placeholders as many as its tokens, the loss on the
answers only; unreadable types and non-datasets refused in one line; `mimo run` on a blend of all formats alike
colocated and heterogeneous; the Nemotron VLM trains on a chat dataset."""

from __future__ import annotations

import random
import re

import pytest
import torch

import mimo
from format_datasets import BUILDERS, COLOURS, FORMATS, LOOKS, picture, prepare, write
from helpers import read_metrics, run_mimo
from mimo.errors import UsageError
from mimo.plugins import DataContext, Registry
from mimo.plugins.settings import build_settings
from mimo.testing import ContractError, check_model_shape, check_specs
from mimo.testing.data_path_check import check_data_path
from mimo.testing.subject import load_subject

PROVIDERS = ("mock-vlm", "nemotron-moe-vlm-tiny", "qwen3.5-vl-tiny")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """{format: (path, {key: expected})} for every format, and a metadataset blending them all ("blend")."""
    root = tmp_path_factory.mktemp("formats")
    rng = random.Random(7)
    found = {name: (root / name, BUILDERS[name](root / name, rng)) for name in FORMATS}
    blend = "".join(f"      - weight: 1\n        path: {name}\n" for name in FORMATS)
    (root / "blend.yaml").write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n"
                                     "    blend:\n" + blend)
    found["blend"] = (root / "blend.yaml", {})
    return found


# --------------------------------------------------------------------------------------------------------------
# in process: the provider's data_provider hook, through the real loader


def provider_settings(provider: str, *assignments: str):
    registry = Registry()
    entry, _ = registry.get(provider)
    return registry, build_settings(entry, ["shuffle_buffer=0", *assignments])


def data_tools(provider: str, settings):
    """(tokenizer to decode with, tokens an image of (h, w) takes) as the provider reads --data."""
    if provider == "mock-vlm":
        from mimo.data import ByteTokenizer

        tok = ByteTokenizer(vocab_size=settings.vocab_size)
        tok.image_token_id = settings.image_token_id
        return tok, lambda h, w: settings.image_tokens
    if provider == "qwen3.5-vl-tiny":  # the processor's grid, 3-D positions
        from mimo.providers.qwen35.tokens import data_tokenizer

        return data_tokenizer(settings), settings.image_mode().num_tokens
    from mimo.providers.nemotron.data import image_mode
    from mimo.providers.nemotron.tokens import data_tokenizer

    return data_tokenizer(settings), image_mode(settings).num_tokens


def read_rows(provider: str, path, count: int, *assignments: str, skipped: int = 0):
    """(settings, [(key, input_ids row, labels row, loss_mask row)], [micro-batches]) of `count` micro-batches, at
    most `skipped` samples skipped."""
    registry, settings = provider_settings(provider, *assignments)
    ctx = DataContext(micro_batch_size=2, num_microbatches=1, num_lanes=1, seed=0, data_path=str(path))
    loader = registry.hooks(provider).data_provider(settings=settings, ctx=ctx)
    rows, batches = [], []
    try:
        for _ in range(count):
            batch = next(loader)
            batches.append(batch)
            for r, (_, _, _, key) in enumerate(loader.last_rows):
                rows.append((key, batch["input_ids"][r], batch["labels"][r], batch["loss_mask"][r]))
        assert loader.skipped_samples <= skipped
    finally:
        loader.close()
    return settings, rows, batches


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_every_text_field_and_image_reaches_the_model(datasets, provider, name):
    path, expected = datasets[name]
    # Qwen's processor refuses images of aspect ratio above 200 (3 x 700): skipped samples, as in transformers
    refused = {key for key, want in expected.items() if provider.startswith("qwen")
               and any(max(h, w) > 200 * min(h, w) for h, w in want["images"])}
    expected = {key: want for key, want in expected.items() if key not in refused}
    settings, rows, batches = read_rows(provider, path, -(-len(expected) // 2), "seq_length=512",
                                        skipped=len(refused))
    tok, tokens_of = data_tools(provider, settings)
    assert {key for key, *_ in rows} == set(expected)  # one epoch, every sample once
    for key, ids, labels, mask in rows:
        want = expected[key]
        seen = tok.decode(ids, skip_special_tokens=False)
        trained = tok.decode(labels[mask > 0], skip_special_tokens=False)
        for text in want["texts"]:
            assert text in seen, (key, text, seen)
        for answer in want["answers"]:
            assert answer in trained, (key, answer, trained)
        for prompt in want["prompts"]:
            assert prompt not in trained, (key, prompt, trained)
        placeholders = int((ids == tok.image_token_id).sum())
        assert placeholders == sum(tokens_of(h, w) for h, w in want["images"]), key
        assert not (labels[mask > 0] == tok.image_token_id).any()  # never trained to predict a placeholder
    images = sum(len(expected[key]["images"]) for key, *_ in rows)
    encoder_inputs = [next(iter(b["modality_inputs"]["images"].values())) for b in batches if b["modality_inputs"]]
    counted = sum(int(x["imgs_sizes"].shape[0]) if "imgs_sizes" in x else int(x["grid_thw"].shape[0])
                  if "grid_thw" in x else int(x["x"].shape[0]) for x in encoder_inputs)
    assert counted == images


def expected_nemotron_text(chat: dict, image_tokens: list[int]) -> tuple[str, str]:
    """The Nemotron VL prompt of a chat JSON and its trained text, written out independently of mimo's template."""
    turns = ([("system", chat["system"])] if "system" in chat else []) + [
        ({"human": "user", "gpt": "assistant"}.get(m.get("from"), m.get("role")), m.get("value", m.get("content")))
        for m in chat.get("conversations") or chat["messages"]]
    turns = [(role, text if isinstance(text, str) else text[0]["text"]) for role, text in turns]
    runs = iter(f"<img>{'<image>' * n}</img>" for n in image_tokens)
    if image_tokens and not any("<image>" in t for _, t in turns):
        first = next(i for i, (role, _) in enumerate(turns) if role == "user")
        turns[first] = ("user", "<image>" * len(image_tokens) + turns[first][1])
    text = "".join(f"<|im_start|>{role}\n{re.sub('<image>', lambda _: next(runs), t)}<|im_end|>\n"
                   for role, t in turns)
    return text, "".join(f"{t}<|im_end|>" for role, t in turns if role == "assistant")


def test_a_chat_batch_decodes_to_its_conversation_with_the_loss_on_the_answers(datasets):
    path, expected = datasets["chat"]
    settings, rows, _ = read_rows("nemotron-moe-vlm-tiny", path, 2, "seq_length=512")
    tok, tokens_of = data_tools("nemotron-moe-vlm-tiny", settings)
    for key, ids, labels, mask in rows:
        want = expected[key]
        text, trained = expected_nemotron_text(want["chat"], [tokens_of(h, w) for h, w in want["images"]])
        assert re.sub(r"(<pad>)+$", "", tok.decode(ids, skip_special_tokens=False)) == text, key
        assert tok.decode(labels[mask > 0], skip_special_tokens=False) == trained, key
        # the mask is exactly the assistant turns: every masked label lies inside one
        inside = _assistant_spans(ids, tok)
        assert all(inside[i + 1] for i in mask.nonzero().flatten().tolist()), key


def _assistant_spans(ids: torch.Tensor, tok) -> list[bool]:
    """Per position: inside an assistant turn's content or its <|im_end|> (after its header)."""
    start, end = tok.encode("<|im_start|>")[0], tok.encode("<|im_end|>")[0]
    header = tok.encode("<|im_start|>assistant\n")
    out, inside, i = [False] * len(ids), False, 0
    ids = ids.tolist()
    while i < len(ids):
        if ids[i:i + len(header)] == header:
            inside, i = True, i + len(header)
            continue
        if ids[i] == start:
            inside = False
        out[i] = inside
        if ids[i] == end:
            inside = False
        i += 1
    return out


def test_a_restored_chat_loader_continues_the_exact_stream(datasets):
    """Crude samples are cooked again when energon restores its state (in a worker process here)."""
    registry, settings = provider_settings("nemotron-moe-vlm-tiny", "seq_length=256", "shuffle_buffer=8")
    ctx = DataContext(micro_batch_size=2, num_microbatches=1, num_lanes=1, seed=4,
                      data_path=str(datasets["chat"][0]), num_workers=1)

    def read(loader, count):
        return [(next(loader)["input_ids"], [row[3] for row in loader.last_rows]) for _ in range(count)]

    first = registry.hooks("nemotron-moe-vlm-tiny").data_provider(settings=settings, ctx=ctx)
    read(first, 3)
    state = first.state_dict()
    want = read(first, 3)
    first.close()
    again = registry.hooks("nemotron-moe-vlm-tiny").data_provider(settings=settings, ctx=ctx)
    again.load_state_dict(state)
    got = read(again, 3)
    again.close()
    assert [keys for _, keys in got] == [keys for _, keys in want]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got, want))


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_dataset_of_another_sample_type_is_refused_in_one_line(tmp_path, provider):
    data, ext, _ = picture(LOOKS[3], "red")
    write(tmp_path / "ocr", [{"__key__": f"o{i}", ext: data, "txt": "TEXT"} for i in range(4)])
    prepare(tmp_path / "ocr", "OCRSample", {"image": "png", "text": "txt"})
    registry, settings = provider_settings(provider)
    ctx = DataContext(micro_batch_size=2, num_microbatches=1, num_lanes=1, seed=0, data_path=str(tmp_path / "ocr"))
    with pytest.raises(UsageError) as err:
        registry.hooks(provider).data_provider(settings=settings, ctx=ctx)
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert "cannot read OCRSample samples; it reads CaptioningSample, VQASample" in message
    assert "CrudeWebdataset (chat)" in message


def test_the_nemotron_vlm_refuses_a_folder_that_is_not_a_dataset(tmp_path):
    registry, settings = provider_settings("nemotron-moe-vlm-tiny")
    (tmp_path / "photos").mkdir()
    ctx = DataContext(micro_batch_size=2, num_microbatches=1, num_lanes=1, seed=0, data_path=str(tmp_path / "photos"))
    with pytest.raises(UsageError, match="not an energon dataset"):
        registry.hooks("nemotron-moe-vlm-tiny").data_provider(settings=settings, ctx=ctx)


def test_the_contract_kit_catches_a_provider_that_ignores_data():
    from mimo.providers import mock_vlm

    def plugin(data_provider):
        module = type(mock_vlm)("third_party_vlm")
        for hook in ("register_providers", "model_shape", "build_encoders", "build_language_model",
                     "frozen_parameters"):
            setattr(module, hook, getattr(mock_vlm, hook))
        module.data_provider = mimo.hookimpl(data_provider)
        return load_subject("mock-vlm", registry=Registry([("third", "third-vlm 1.0", lambda: module)]))

    def synthetic_only(settings, ctx):
        from mimo.providers.mock_vlm.data import synthetic_batches

        return synthetic_batches(settings, ctx)

    def refuses(settings, ctx):
        if ctx.data_path:
            raise UsageError(f"--data {ctx.data_path}: third-vlm reads no datasets")
        return synthetic_only(settings, ctx)

    def check(data_provider):
        subject = plugin(data_provider)
        encoders, _ = check_specs(subject, check_model_shape(subject))
        return check_data_path(subject, encoders)

    with pytest.raises(ContractError, match="data_provider: given ctx.data_path = a folder that is not an energon "
                                            "dataset it returned micro-batches"):
        check(synthetic_only)
    assert "refuses --data" in check(refuses)
    assert check(mock_vlm.data_provider) is None


# --------------------------------------------------------------------------------------------------------------
# `mimo run`


def train(tmp_path, name, *args):
    metrics = tmp_path / f"{name}.jsonl"
    result = run_mimo("run", "--device", "cpu", "--log-interval", "1", "--metrics-file", str(metrics), *args,
                      env={"TORCH_COMPILE_DISABLE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(metrics)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_blend_of_every_format_trains_alike_colocated_and_heterogeneous(tmp_path, datasets, provider):
    # Qwen's processor refuses the 3 x 700 images (aspect ratio above 200): a quarter of the samples are skipped, so
    # the first sequence samples come later
    qwen = provider.startswith("qwen")
    iterations = 4 if qwen else 3
    common = ("--provider", provider, "--data", str(datasets["blend"][0]), "--train-iters", str(iterations),
              "--seed", "5", "--set", "seq_length=512", "--packing-buffer-size", "8",
              *(("--max-skip-fraction", "1") if qwen else ()))
    # the samples these runs train on (packed, as --data packs by default): every format is among them
    registry = Registry()
    settings = build_settings(registry.get(provider)[0], ["seq_length=512"])
    ctx = DataContext(micro_batch_size=4, num_microbatches=1, num_lanes=1, seed=5, num_workers=2,
                      data_path=str(datasets["blend"][0]), pack_sequences=True, packing_buffer_size=8)
    loader = registry.hooks(provider).data_provider(settings=settings, ctx=ctx)
    keys = []
    try:
        for _ in range(iterations):
            batch = next(loader)
            keys += [key for row in loader.last_rows for key in row[3].split(",")]
    finally:
        loader.close()
    assert "packing_kwargs" in batch and len(keys) > 12  # several samples share a sequence
    assert {name for name in FORMATS if set(keys) & set(datasets[name][1])} == set(FORMATS), " ".join(keys)

    colocated = train(tmp_path, "colocated", *common)
    split = train(tmp_path, "split", *common, "--nproc-per-node", "2", "--encoder-ranks", "1")
    assert len(colocated) == len(split) == iterations
    for a, b in zip(colocated, split):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5), a["iteration"]
        assert a.get("skipped_samples", 0) == b.get("skipped_samples", 0)
        assert qwen or a.get("skipped_samples", 0) == 0


def test_the_nemotron_vlm_trains_on_a_chat_dataset(tmp_path):
    """`mimo run --provider nemotron-moe-vlm-tiny --data DIR --device cpu` as is: the loss falls, and the run is
    not the synthetic one."""
    rng, samples = random.Random(3), []
    for i in range(32):
        colour = rng.choice(list(COLOURS))
        data, ext, _ = picture((32 + 8 * (i % 4), 32, "RGB", "jpg"), colour)
        chat = {"conversations": [{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": colour}]}
        samples.append({"__key__": f"{i:04d}", ext: data, "json": chat})
    write(tmp_path / "chat", samples)
    prepare(tmp_path / "chat", "CrudeWebdataset")
    real = [r["lm_loss"] for r in train(tmp_path, "chat", "--provider", "nemotron-moe-vlm-tiny", "--data",
                                        str(tmp_path / "chat"), "--train-iters", "30")]
    assert len(real) == 30 and sum(real[-5:]) < 0.8 * sum(real[:5]), real
    synthetic = [r["lm_loss"] for r in train(tmp_path, "synthetic", "--provider", "nemotron-moe-vlm-tiny",
                                             "--train-iters", "3")]
    assert all(abs(a - b) > 1e-3 for a, b in zip(real, synthetic)), (real[:3], synthetic)
