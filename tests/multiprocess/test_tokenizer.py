"""A Hugging Face tokenizer folder read with the `tokenizers` library alone: a byte-level BPE trained here and saved
as transformers saves one (tokenizer.json, tokenizer_config.json); the Nemotron VL template's markers as single
ids, a rendered conversation decoding back to its text, the loss on the assistant turns only; special tokens from
the config files as transformers reads them; bad folders refused in one line; the Nemotron VLM reading and
training on a chat dataset with `tokenizer_path`."""

from __future__ import annotations

import json
import math
import random
import sys

import pytest

from format_datasets import UNICODE, build_chat
from helpers import read_metrics, run_mimo
from mimo.data import NEMOTRON, Turn, load_hf_tokenizer
from mimo.data.conversation import IMAGE, place_images, turns_from_chat_json
from mimo.errors import UsageError

SENTENCES = ["What colour is the circle?", "A red circle on a white background.", "The square is blue.",
             "Describe the picture, please.", f"Count the discs: {UNICODE}."]
UNK, EOS, BOS = "<unk>", "</s>", "<s>"


@pytest.fixture(scope="module")
def trained():
    """A byte-level BPE as GPT-style tokenizers are: every byte has a token, merges learnt from SENTENCES. It adds
    bos/eos when asked (a post-processor) and pads to 32 tokens, as some saved tokenizers do: mimo must do neither."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(SENTENCES, trainers.BpeTrainer(
        vocab_size=320, special_tokens=[UNK, EOS, BOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    ids = {t: tokenizer.token_to_id(t) for t in (UNK, EOS, BOS)}
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A {EOS}",
                                                             special_tokens=[(BOS, ids[BOS]), (EOS, ids[EOS])])
    tokenizer.enable_padding(length=32, pad_id=ids[EOS], pad_token=EOS)
    return tokenizer


def save_folder(tokenizer, folder, config: dict | None = None, special_tokens_map: dict | None = None):
    """tokenizer.json and a tokenizer_config.json as transformers (4.34 or later) writes them: the added tokens by
    id, the named special tokens as strings; `config` replaces that config."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    listing = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                        "single_word": t.single_word, "special": t.special}
               for i, t in tokenizer.get_added_tokens_decoder().items()}
    if config is None:
        config = {"added_tokens_decoder": listing, "bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
                  "clean_up_tokenization_spaces": False, "model_max_length": 4096,
                  "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if special_tokens_map is not None:
        (folder / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    return folder


# --------------------------------------------------------------------------------------------------------------
# the Nemotron VL template through a tokenizer folder


LLAVA = {"system": "Be brief.", "conversations": [
    {"from": "human", "value": "<image>\nWhat colour is the circle?"}, {"from": "gpt", "value": "A red circle."},
    {"from": "human", "value": f"And <image>? {UNICODE}"}, {"from": "gpt", "value": "The square is blue."}]}


def test_the_nemotron_template_renders_through_a_tokenizer_folder(tmp_path, trained, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # importing it fails: the folder must not need it
    base = trained.get_vocab_size()
    tok = load_hf_tokenizer(save_folder(trained, tmp_path / "tok"), special_tokens=NEMOTRON.special_tokens)
    NEMOTRON.check_tokenizer(tok)
    markers = [tok.encode(t) for t in NEMOTRON.special_tokens]
    assert all(len(ids) == 1 for ids in markers) and len({ids[0] for ids in markers}) == 4
    # the markers and <image> are new ids after the trained vocabulary; eos/bos keep theirs; pad falls back to eos
    assert sorted([ids[0] for ids in markers] + [tok.image_token_id]) == list(range(base, base + 5))
    assert tok.vocab_size == base + 5 and tok.encode("<image>") == [tok.image_token_id]
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (trained.token_to_id(EOS), trained.token_to_id(BOS),
                                                   trained.token_to_id(EOS))
    plain = tok.encode("A red circle.")  # no bos or eos added, no padding; merges learnt
    assert tok.decode(plain) == "A red circle." and len(plain) < len("A red circle.")
    assert tok.eos_id not in plain and tok.bos_id not in plain

    out = NEMOTRON.render(place_images(turns_from_chat_json(LLAVA), 2), [3, 2], tok)
    assert tok.decode(out.tokens, skip_special_tokens=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<img><image><image><image></img>\nWhat colour is the circle?<|im_end|>\n"
        "<|im_start|>assistant\nA red circle.<|im_end|>\n"
        f"<|im_start|>user\nAnd <img><image><image></img>? {UNICODE}<|im_end|>\n"
        "<|im_start|>assistant\nThe square is blue.<|im_end|>\n")
    assert tok.decode(out.tokens) == f"system\nBe brief.\nuser\n\nWhat colour is the circle?\nassistant\nA red " \
                                     f"circle.\nuser\nAnd ? {UNICODE}\nassistant\nThe square is blue.\n"
    # the loss mask: exactly the assistant turns' content and their <|im_end|>, nothing of a header or an image
    trained_ids = [t for t, keep in zip(out.tokens, out.trained) if keep]
    assert tok.decode(trained_ids, skip_special_tokens=False) == "A red circle.<|im_end|>The square is blue.<|im_end|>"
    header = tok.encode("<|im_start|>assistant\n")
    answers = [i + len(header) for i in range(len(out.tokens)) if out.tokens[i:i + len(header)] == header]
    end = tok.encode("<|im_end|>")[0]
    spans = [set(range(a, out.tokens.index(end, a) + 1)) for a in answers]
    assert {i for i, keep in enumerate(out.trained) if keep} == set().union(*spans)
    assert [out.tokens[s:s + n] for s, n in out.image_runs] == [[tok.image_token_id] * 3, [tok.image_token_id] * 2]


def test_a_document_is_framed_by_the_folders_bos_and_eos(tmp_path, trained):
    tok = load_hf_tokenizer(save_folder(trained, tmp_path / "tok"), special_tokens=NEMOTRON.special_tokens)
    out = NEMOTRON.render([Turn("document", ("Look:", IMAGE, "a circle."))], [2], tok)
    assert out.tokens[0] == tok.bos_id and out.tokens[-1] == tok.eos_id
    assert tok.decode(out.tokens, skip_special_tokens=False) == "<s>Look:<img><image><image></img>a circle.</s>"


# --------------------------------------------------------------------------------------------------------------
# special and added tokens as transformers reads them


def test_a_special_tokens_map_counts_only_without_added_tokens_decoder(tmp_path, trained):
    base = trained.get_vocab_size()
    # no added_tokens_decoder (transformers before 4.34, and 5): the config's tokens may be AddedToken objects, and
    # special_tokens_map.json overrides them
    config = {"eos_token": {"__type": "AddedToken", "content": BOS, "lstrip": False, "normalized": False,
                            "rstrip": False, "single_word": False}, "unk_token": UNK}
    tok = load_hf_tokenizer(save_folder(trained, tmp_path / "old", config, {
        "eos_token": {"content": EOS, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
        "pad_token": "<pad>", "additional_special_tokens": ["<|im_start|>"]}))
    assert tok.eos_id == trained.token_to_id(EOS) and tok.bos_id is None
    assert tok.pad_id == base and tok.encode("<|im_start|><pad>") == [base + 1, base]  # added, in that order
    assert tok.image_token_id == base + 2 and tok.vocab_size == base + 3
    # with added_tokens_decoder in the config (transformers 4.34 to 4.x), transformers ignores special_tokens_map.json
    newer = {"added_tokens_decoder": {}, "eos_token": EOS}
    tok = load_hf_tokenizer(save_folder(trained, tmp_path / "new", newer, {"pad_token": "<pad>"}))
    assert tok.pad_id == tok.eos_id and tok.vocab_size == base + 1  # <image> only


def test_listed_added_tokens_and_vocabulary_markers(tmp_path, trained):
    base = trained.get_vocab_size()
    folder = save_folder(trained, tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    # an added token the config lists but tokenizer.json lacks (a hand-edited folder): added, not special
    config["added_tokens_decoder"][str(base)] = {"content": "<note>", "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False, "special": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    # a marker that is already a word of the vocabulary keeps its id and becomes one token wherever it stands
    word = max((t for t in trained.get_vocab(with_added_tokens=False) if t.isalpha()), key=len)
    tok = load_hf_tokenizer(folder, special_tokens=(word,))
    assert tok.encode("<note>") == [base] and tok.decode([base]) == "<note>"
    assert tok.encode(word) == [trained.token_to_id(word)] and tok.vocab_size == base + 2  # <note>, <image>


def _no_tokenizer_json(folder):
    (folder / "tokenizer.json").unlink()


def _write(name: str, text: str):
    return lambda folder: (folder / name).write_text(text)


def _config(**changes):
    def change(folder):
        config = {**json.loads((folder / "tokenizer_config.json").read_text()), **changes}
        (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return change


@pytest.mark.parametrize("spoil, message", [
    (None, "tokenizer folder {folder} does not exist"),
    (_no_tokenizer_json, "tokenizer folder {folder} has no tokenizer.json, the file a Hugging Face fast tokenizer "
                         "is read from: save the tokenizer with transformers, AutoTokenizer.from_pretrained(NAME)"
                         ".save_pretrained(FOLDER)"),
    (_write("tokenizer.json", '{"version": "1.0", "model": '), "{folder}/tokenizer.json is not a tokenizers file: "),
    (_write("tokenizer_config.json", "eos_token: </s>"), "{folder}/tokenizer_config.json cannot be read as JSON: "),
    (_config(eos_token=None), "tokenizer folder {folder}: tokenizer_config.json names no eos_token"),
    (_config(eos_token=2), "{folder}/tokenizer_config.json: eos_token must be a string or an object with a "
                           "\"content\" string, not 2"),
    (_config(added_tokens_decoder={"7": {"content": "<x>", "special": "yes"}}),
     "{folder}/tokenizer_config.json: added_tokens_decoder entry 7 must be an object with a \"content\" string and "
     "boolean flags"),
], ids=["missing", "no tokenizer.json", "broken tokenizer.json", "config not JSON", "no eos", "eos a number",
        "bad added token"])
def test_a_folder_that_cannot_be_read_is_one_line(tmp_path, trained, spoil, message):
    folder = tmp_path / "tok"
    if spoil is not None:
        spoil(save_folder(trained, folder))
    with pytest.raises(UsageError) as err:
        load_hf_tokenizer(folder)
    assert str(err.value).startswith(message.format(folder=folder)) and len(str(err.value).splitlines()) == 1


# --------------------------------------------------------------------------------------------------------------
# the Nemotron VLM with tokenizer_path


def test_the_nemotron_vlm_reads_and_trains_on_chat_with_a_tokenizer_folder(tmp_path, trained):
    from mimo.plugins import DataContext, Registry
    from mimo.plugins.settings import build_settings
    from mimo.providers.nemotron.tokens import image_token_id

    folder = save_folder(trained, tmp_path / "tok")
    vocab = load_hf_tokenizer(folder, special_tokens=NEMOTRON.special_tokens).vocab_size
    expected = build_chat(tmp_path / "chat", random.Random(5))
    assignments = [f"tokenizer_path={folder}", f"vocab_size={vocab}", "seq_length=512"]  # no sample is cut

    # in process: the provider's micro-batches are the folder's tokens, its <image> the model's placeholder
    registry = Registry()
    settings = build_settings(registry.get("nemotron-moe-vlm-tiny")[0], ["shuffle_buffer=0", *assignments])
    tok = load_hf_tokenizer(folder, special_tokens=NEMOTRON.special_tokens)
    assert image_token_id(settings) == tok.image_token_id == vocab - 1  # the last id the folder's tokenizer added
    ctx = DataContext(micro_batch_size=2, num_microbatches=1, num_lanes=1, seed=0, data_path=str(tmp_path / "chat"))
    loader = registry.hooks("nemotron-moe-vlm-tiny").data_provider(settings=settings, ctx=ctx)
    try:
        batch = next(loader)
        keys = [row[3] for row in loader.last_rows]
        assert len(keys) == 2
    finally:
        loader.close()
    for key, ids, labels, mask in zip(keys, batch["input_ids"], batch["labels"], batch["loss_mask"]):
        text = tok.decode(ids, skip_special_tokens=False)
        learned = tok.decode(labels[mask > 0], skip_special_tokens=False)
        assert text.startswith("<|im_start|>") and all(piece in text for piece in expected[key]["texts"]), key
        assert learned == "".join(f"{answer}<|im_end|>" for answer in expected[key]["answers"]), key
        assert int((ids == tok.image_token_id).sum()) > 0 or not expected[key]["images"], key

    # `mimo run`: it trains; one id fewer than the folder's tokenizer needs is refused in one line
    def run(*extra):
        return run_mimo("run", "--provider", "nemotron-moe-vlm-tiny", "--device", "cpu", "--data",
                        str(tmp_path / "chat"), "--train-iters", "4", "--log-interval", "1", "--metrics-file",
                        str(tmp_path / "metrics.jsonl"), *[a for s in extra for a in ("--set", s)],
                        env={"TORCH_COMPILE_DISABLE": "1"})

    result = run(*assignments)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [m["lm_loss"] for m in read_metrics(tmp_path / "metrics.jsonl")]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert all(m.get("skipped_samples", 0) == 0 for m in read_metrics(tmp_path / "metrics.jsonl"))
    small = run(f"tokenizer_path={folder}", f"vocab_size={vocab - 1}")
    assert small.returncode == 2 and "Traceback" not in small.stderr
    assert f"has {vocab} token ids (the chat template's markers and <image> included), more than vocab_size " \
           f"{vocab - 1}: --set vocab_size={vocab} or more" in small.stderr.strip().splitlines()[-1]
