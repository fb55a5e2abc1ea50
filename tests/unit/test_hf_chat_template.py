"""A tokenizer folder's own Jinja chat template (`hf_chat_template.py`): tiny byte-level BPE folders written here
with templates of the two kinds (answers found by rendering prefixes; answers in `{% generation %}` tags), checked
for token ids, the trained tokens (each answer and its end of turn, nothing else), image placeholders expanded,
multi-turn and text-only conversations, documents, the generation prompt and stop ids; against transformers' own
`apply_chat_template` where it marks the answers; folders without a template falling back; templates that cannot
render refused in one line. The Nemotron provider's choice: test_nemotron_chat_template.py."""

from __future__ import annotations

import json

import pytest

from mimo.data import HFTokenizer, Turn, load_hf_tokenizer
from mimo.data.conversation import IMAGE
from mimo.data.hf_chat_template import (
    HFChatTemplate, ImageMarkers, load_hf_chat_template, select_chat_template, template_source,
)
from mimo.errors import UsageError

SENTENCES = ["What colour is the circle?", "A red circle on a white background.", "The square is blue.",
             "You are a helpful assistant.", "Describe the picture, please."]
MARKERS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|start|>",
           "<|sep|>", "<|eot|>", "<img>", "</img>", "<image>"]
BOS, EOS = "<s>", "</s>"

# In the style of Qwen's: ChatML turns, a default system turn when the conversation has none, images as
# <|vision_start|><|image_pad|><|vision_end|>; no generation tags.
CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# In the style of Llama 3's, with the answers in generation tags: bos first, headers, images as <image>.
TAGGED = (
    "{{ bos_token }}{% for message in messages %}<|start|>{{ message['role'] }}<|sep|>\n\n"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% else %}{% set content = namespace(text='') %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{% set content.text = content.text + '<image>' %}"
    "{% else %}{% set content.text = content.text + part['text'] %}{% endif %}{% endfor %}"
    "{% set content = content.text %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ content | trim }}<|eot|>{% endgeneration %}"
    "{% else %}{{ content | trim }}<|eot|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|sep|>\n\n{% endif %}")
QWEN_IMAGE = ImageMarkers("<|image_pad|>")
NEMOTRON_IMAGE = ImageMarkers("<image>", "<img>", "</img>")


@pytest.fixture(scope="module")
def backend():
    """A byte-level BPE as GPT-style tokenizers are: every byte a token, merges learnt from SENTENCES, the markers
    special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(SENTENCES, trainers.BpeTrainer(
        vocab_size=400, special_tokens=[BOS, EOS, *MARKERS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tokenizer


def folder_with(tmp_path, backend, name: str, template: str | None, where: str = "config"):
    """A tokenizer folder as transformers saves one, its template in tokenizer_config.json or chat_template.jinja."""
    folder = tmp_path / name
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None and where == "config":
        config["chat_template"] = template
    if template is not None and where == "jinja":
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def loaded(tmp_path, backend, template, image=QWEN_IMAGE, image_token="<|image_pad|>", where="config", name="tok"):
    folder = folder_with(tmp_path, backend, name, template, where)
    chat = load_hf_chat_template(folder, image)
    tokenizer = load_hf_tokenizer(folder, image_token=image_token, special_tokens=chat.special_tokens)
    chat.check_tokenizer(tokenizer)
    return chat, tokenizer


def trained_runs(tokenizer, rendered) -> list[str]:
    """The trained tokens' text, one string per run of trained tokens."""
    runs, run = [], []
    for token, trained in zip(rendered.tokens + [None], rendered.trained + [False]):
        if trained:
            run.append(token)
        elif run:
            runs.append(tokenizer.decode(run, skip_special_tokens=False))
            run = []
    return runs


CHAT = [Turn("system", ("Be brief.",)), Turn("user", (IMAGE, "What colour is the circle?")),
        Turn("assistant", ("A red circle.",)), Turn("user", ("And the square?",)),
        Turn("assistant", ("The square is blue.",))]


def test_answers_found_without_tags_images_expanded_and_ids_as_the_whole_text_encodes(tmp_path, backend):
    chat, tok = loaded(tmp_path, backend, CHATML)
    assert not chat.tagged and chat.answer_end == "<|im_end|>"
    rendered = chat.render(CHAT, [3], tok)
    text = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 3
            + "<|vision_end|>What colour is the circle?<|im_end|>\n<|im_start|>assistant\nA red circle.<|im_end|>\n"
              "<|im_start|>user\nAnd the square?<|im_end|>\n<|im_start|>assistant\nThe square is blue.<|im_end|>\n")
    assert rendered.tokens == tok.encode(text)
    assert trained_runs(tok, rendered) == ["A red circle.<|im_end|>", "The square is blue.<|im_end|>"]
    start = rendered.tokens.index(tok.image_token_id)
    assert rendered.image_runs == [(start, 3)] and rendered.tokens[start - 1] == tok.encode("<|vision_start|>")[0]
    assert not any(rendered.trained[start:start + 3])
    # text only, no system turn: the template's own system turn comes first, untrained
    plain = chat.render([Turn("user", ("Describe the picture, please.",)),
                         Turn("assistant", ("A red circle on a white background.",))], [], tok)
    assert plain.tokens == tok.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                                      "Describe the picture, please.<|im_end|>\n<|im_start|>assistant\n"
                                      "A red circle on a white background.<|im_end|>\n")
    assert trained_runs(tok, plain) == ["A red circle on a white background.<|im_end|>"] and not plain.image_runs


def test_answers_in_generation_tags_with_image_markers_around_the_placeholders(tmp_path, backend):
    chat, tok = loaded(tmp_path, backend, TAGGED, NEMOTRON_IMAGE, "<image>", where="jinja")
    assert chat.tagged and chat.answer_end == "<|eot|>" and chat.special_tokens == ("<image>", "<img>", "</img>")
    rendered = chat.render(CHAT, [2], tok)
    text = ("<s><|start|>system<|sep|>\n\nBe brief.<|eot|><|start|>user<|sep|>\n\n<img>" + "<image>" * 2
            + "</img>What colour is the circle?<|eot|><|start|>assistant<|sep|>\n\nA red circle.<|eot|>"
              "<|start|>user<|sep|>\n\nAnd the square?<|eot|><|start|>assistant<|sep|>\n\nThe square is blue.<|eot|>")
    assert rendered.tokens == tok.encode(text)
    assert trained_runs(tok, rendered) == ["A red circle.<|eot|>", "The square is blue.<|eot|>"]
    start = rendered.tokens.index(tok.image_token_id)
    assert rendered.image_runs == [(start, 2)]
    assert rendered.tokens[start - 1] == tok.encode("<img>")[0] and rendered.tokens[start + 2] == tok.encode("</img>")[0]


@pytest.mark.parametrize("template", [CHATML, TAGGED])
def test_ids_and_trained_tokens_match_transformers_apply_chat_template(tmp_path, backend, template):
    transformers = pytest.importorskip("transformers")
    chat, tok = loaded(tmp_path, backend, template)
    turns = [t for t in CHAT if not t.num_images] + [Turn("user", ("Why?",)), Turn("assistant", ("Because.",))]
    messages = [{"role": t.role, "content": "".join(t.parts)} for t in turns]
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    rendered = chat.render(turns, [], tok)
    if template is TAGGED:  # transformers marks the tagged answers itself
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert rendered.trained == [bool(m) for m in out["assistant_masks"]]
    else:
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True)
    assert rendered.tokens == list(out["input_ids"])
    wrapped = chat.render(turns, [], HFTokenizer(hf, image_token="<|image_pad|>"))  # a transformers tokenizer
    assert (wrapped.tokens, wrapped.trained) == (rendered.tokens, rendered.trained)
    prompt = chat.generation_prompt(turns[:-1], [], tok)
    assert prompt == list(hf.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])


def test_generation_prompt_stop_ids_and_documents(tmp_path, backend):
    chat, tok = loaded(tmp_path, backend, CHATML)
    question = [Turn("user", (IMAGE, "What colour is the circle?"))]
    assert chat.generation_prompt(question, [2], tok) == tok.encode(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
        "<|image_pad|><|image_pad|><|vision_end|>What colour is the circle?<|im_end|>\n<|im_start|>assistant\n")
    assert chat.stop_ids(tok) == {tok.eos_id, tok.encode("<|im_end|>")[0]}
    # a document is its text between bos and eos, trained, with no chat turns around it
    doc = chat.render([Turn("document", ("The square is blue.", IMAGE))], [2], tok)
    body = tok.encode("The square is blue.")
    assert doc.tokens == [tok.bos_id, *body, tok.image_token_id, tok.image_token_id, tok.eos_id]
    assert doc.trained == [False] + [True] * len(body) + [False, False, True]
    assert doc.image_runs == [(1 + len(body), 2)]
    assert chat.generation_prompt([Turn("document", ("The square",))], [], tok) == [tok.bos_id,
                                                                                    *tok.encode("The square")]


def test_the_template_source_and_the_choice_of_template(tmp_path, backend):
    from mimo.data import NEMOTRON, PLAIN

    both = folder_with(tmp_path, backend, "both", "{{ 'config' }}")
    (both / "chat_template.jinja").write_text("{{ 'jinja' }}")
    assert template_source(both) == "{{ 'jinja' }}"  # as transformers: the .jinja file over the config's
    named = folder_with(tmp_path, backend, "named", None)
    (named / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "chat_template": [
        {"name": "tool_use", "template": "{{ 'tools' }}"}, {"name": "default", "template": CHATML}]}))
    assert template_source(named) == CHATML
    bare = folder_with(tmp_path, backend, "bare", None)
    assert template_source(bare) is None
    # auto: the folder's own template where it has one, else the provider's hand-written default
    assert isinstance(select_chat_template("auto", str(named), default="nemotron", image=QWEN_IMAGE), HFChatTemplate)
    assert select_chat_template("auto", str(bare), default="nemotron", image=QWEN_IMAGE) is NEMOTRON
    assert select_chat_template("auto", None, default="plain", image=QWEN_IMAGE) is PLAIN
    assert select_chat_template("nemotron", str(named), default="plain", image=QWEN_IMAGE) is NEMOTRON
    with pytest.raises(UsageError, match=rf"tokenizer folder {bare} has no chat template"):
        select_chat_template("tokenizer", str(bare), default="nemotron", image=QWEN_IMAGE)
    with pytest.raises(UsageError, match="no tokenizer_path is set"):
        select_chat_template("tokenizer", None, default="nemotron", image=QWEN_IMAGE)


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}{{ m['content'] }}", r"cannot be read: .*(endfor|end of template)"),
    ("{{ raise_exception('Conversation roles must alternate') }}", "Conversation roles must alternate"),
    ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}",
     "trains no assistant answer"),
])
def test_a_template_that_cannot_render_a_question_and_answer_is_one_line_naming_the_folder(
        tmp_path, backend, template, message):
    folder = folder_with(tmp_path, backend, "bad", template)
    with pytest.raises(UsageError, match=message) as caught:
        load_hf_chat_template(folder, QWEN_IMAGE)
    assert str(folder) in str(caught.value) and "\n" not in str(caught.value)


def test_conversations_a_template_cannot_render_are_bad_samples_naming_the_folder(tmp_path, backend):
    no_system = CHATML.replace("{% for message in messages %}", "{% for message in messages %}"
                               "{% if message['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}")
    chat, tok = loaded(tmp_path, backend, no_system)
    with pytest.raises(ValueError, match=rf"chat template of {tmp_path / 'tok'} cannot render this conversation "
                                         r"\(system, user, assistant.*\): no system turns"):
        chat.render(CHAT, [1], tok)
    # a template that ignores image parts has nowhere to put the image
    text_only = CHATML.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
    chat, tok = loaded(tmp_path, backend, text_only, name="text_only")
    with pytest.raises(ValueError, match=r"wrote 0 '<\|image_pad\|>' placeholders for 1 image"):
        chat.render(CHAT, [1], tok)


def test_a_template_whose_earlier_turns_change_asks_for_generation_tags(tmp_path, backend):
    # no newline after the last turn: the turns before an answer render differently once it follows
    last_apart = CHATML.replace("<|im_end|>\n{% endfor %}",
                                "<|im_end|>{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}")
    folder = folder_with(tmp_path, backend, "tok", last_apart)
    with pytest.raises(UsageError, match=r"before answer 1 differently .* \{% generation %\} tags"):
        load_hf_chat_template(folder, QWEN_IMAGE)
    # the same template with the answers tagged is read
    tagged = last_apart.replace("{% if message['content'] is string %}{{ message['content'] }}",
                                "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
                                "{% endgeneration %}{% elif message['content'] is string %}{{ message['content'] }}")
    chat, tok = loaded(tmp_path, backend, tagged, name="tagged")
    assert trained_runs(tok, chat.render(CHAT[:3] + [Turn("user", ("Why?",))], [1], tok)) == ["A red circle."]


def test_without_transformers_the_template_is_refused_naming_the_install(tmp_path, backend, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "transformers.utils.chat_template_utils", None)
    folder = folder_with(tmp_path, backend, "tok", CHATML)
    with pytest.raises(UsageError, match=r"rendered by transformers, which this install lacks: pip install "
                                         r"'mimo\[hf\]'"):
        load_hf_chat_template(folder, QWEN_IMAGE)


def test_the_task_encoder_learns_the_answers_of_a_folders_template(tmp_path, backend):
    import torch

    from mimo.data import ByteTokenizer, ChatSample, ConversationTaskEncoder, FixedTiles

    chat, tok = loaded(tmp_path, backend, CHATML)
    encoder = ConversationTaskEncoder(tok, template=chat, seq_length=256, image_mode=FixedTiles(16, 8))
    sample = ChatSample(__key__="c", __restore_key__=(), turns=CHAT, images=[torch.rand(3, 20, 30)])
    encoded = encoder.encode_sample(sample)
    learned = encoded.labels[encoded.loss_mask > 0].tolist()
    assert tok.decode(learned, skip_special_tokens=False) == "A red circle.<|im_end|>The square is blue.<|im_end|>"
    assert int((encoded.tokens == tok.image_token_id).sum()) == encoded.images[0].num_tokens
    with pytest.raises(ValueError, match="needs a Hugging Face tokenizer"):
        ConversationTaskEncoder(ByteTokenizer(), template=chat, seq_length=64)
