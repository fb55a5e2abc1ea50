"""Conversations and chat templates: chat JSON in both common forms, `<image>` placeholders, every energon sample
type as a conversation, the Nemotron VL prompt format with its loss mask, the byte tokenizer's markers, the crude
chat cooker, and truncation that never splits an image. A Hugging Face tokenizer folder with the template:
test_tokenizer.py."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from megatron.energon import (
    CaptioningSample, InterleavedSample, MultiChoiceVQASample, SimilarityInterleavedSample, TextSample,
    VQASample,
)
from PIL import Image, ImageDraw

from mimo.data import (
    NEMOTRON, PLAIN, ByteTokenizer, ChatSample, ConversationTaskEncoder, DynamicResolution, FixedTiles, Turn,
    cook_chat,
)
from mimo.data.conversation import IMAGE, place_images, turns_from_chat_json
from mimo.data.sample_formats import conversation_of
from mimo.data.skips import TooLong


def drawn(width: int, height: int, colour=(200, 30, 30)) -> torch.Tensor:
    """A PIL drawing as energon decodes it: float [3, H, W] in [0, 1]."""
    image = Image.new("RGB", (width, height), (250, 250, 250))
    ImageDraw.Draw(image).ellipse((width // 4, height // 4, 3 * width // 4, 3 * height // 4), fill=colour)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255


def nemotron_bytes() -> ByteTokenizer:
    return ByteTokenizer(special_tokens=NEMOTRON.special_tokens)


# --------------------------------------------------------------------------------------------------------------
# chat JSON


LLAVA = {"system": "Be brief.", "conversations": [
    {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A circle."},
    {"from": "human", "value": "And <image>?"}, {"from": "gpt", "value": "A square."}]}
MESSAGES = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhat is it?"}]},
    {"role": "assistant", "content": "A circle."},
    {"role": "user", "content": "And <image>?"}, {"role": "assistant", "content": "A square."}]}


def test_both_chat_json_forms_give_the_same_turns():
    want = [Turn("system", ("Be brief.",)), Turn("user", (IMAGE, "\nWhat is it?")), Turn("assistant", ("A circle.",)),
            Turn("user", ("And ", IMAGE, "?")), Turn("assistant", ("A square.",))]
    assert turns_from_chat_json(LLAVA) == want
    assert turns_from_chat_json(MESSAGES) == want


def test_images_go_to_their_placeholders_or_first():
    turns = turns_from_chat_json({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]})
    placed = place_images(turns, 2)
    assert placed[0] == Turn("user", (IMAGE, IMAGE, "Hi")) and placed[1] == turns[1]
    assert place_images(turns_from_chat_json(LLAVA), 2) == turns_from_chat_json(LLAVA)
    with pytest.raises(ValueError, match="2 <image> placeholders but the sample has 1 image$"):
        place_images(turns_from_chat_json(LLAVA), 1)


@pytest.mark.parametrize("data, message", [
    ({"conversations": [{"from": "narrator", "value": "x"}]}, "unknown role 'narrator'"),
    ({"messages": [{"role": "user"}]}, "message 0 must be an object with 'role' and 'content'"),
    ({"text": "hello"}, "neither 'conversations' (from/value) nor 'messages' (role/content)"),
    ({"messages": []}, "must be a non-empty list"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "a content part must be"),
])
def test_bad_chat_json_is_one_clear_error(data, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        turns_from_chat_json(data)
    assert len(str(err.value).splitlines()) == 1


# --------------------------------------------------------------------------------------------------------------
# sample types


def test_every_sample_type_becomes_a_conversation():
    image, other = drawn(20, 30), drawn(30, 20)
    base = dict(__key__="k", __restore_key__=())
    caption = conversation_of(CaptioningSample(**base, image=image, caption="a red circle"))
    assert caption.turns == [Turn("user", (IMAGE,)), Turn("assistant", ("a red circle",))]
    vqa = conversation_of(VQASample(**base, image=image, context="Which <image> colour?", answers=["red", "pink"],
                                    answer_weights=torch.tensor([0.2, 0.8])))
    assert vqa.turns == [Turn("user", ("Which ", IMAGE, " colour?")), Turn("assistant", ("pink",))]
    choice = conversation_of(MultiChoiceVQASample(**base, image=image, context="Shape?", choices=["circle", "square"],
                                                  correct_choice_idx=1))
    assert choice.turns == [Turn("user", (IMAGE, "Shape?\nA. circle\nB. square")), Turn("assistant", ("B. square",))]
    doc = conversation_of(SimilarityInterleavedSample(**base, images=[image, other], texts=["One.", "Two.", "Three."],
                                                      matched_text_indices=[2, 0]))
    assert doc.turns == [Turn("document", (IMAGE, "One. ", "Two. ", IMAGE, "Three."))]
    assert [im is other for im in doc.images] == [True, False]  # in slot order
    seq = conversation_of(InterleavedSample(**base, sequence=["See", image, "here."]))
    assert seq.turns == [Turn("document", ("See", IMAGE, "here."))] and len(seq.images) == 1
    assert conversation_of(TextSample(**base, text="plain words")).turns == [Turn("document", ("plain words",))]
    with pytest.raises(ValueError, match="has no answer to train on"):
        conversation_of(VQASample(**base, image=image, context="?", answers=[]))


# --------------------------------------------------------------------------------------------------------------
# templates and tokenizers


def test_byte_tokenizer_markers_are_single_ids_and_the_image_comes_last():
    tok = nemotron_bytes()
    assert [tok.extra_ids[t] for t in NEMOTRON.special_tokens] == [259, 260, 261, 262]
    assert tok.image_token_id == 263 and tok.vocab_size == 264 and ByteTokenizer().image_token_id == 259
    ids = tok.encode("<|im_start|>user\nü<img></img><|im_end|>")
    assert ids[0] == 259 and ids[-3:] == [261, 262, 260] and tok.decode(ids) == "user\nü"
    assert tok.decode(ids + [tok.image_token_id, tok.eos_id], skip_special_tokens=False) == (
        "<|im_start|>user\nü<img></img><|im_end|><image></s>")


def rows(template, turns, counts, tok):
    out = template.render(turns, counts, tok)
    text = tok.decode(out.tokens, skip_special_tokens=False)
    trained = tok.decode([t for t, keep in zip(out.tokens, out.trained) if keep], skip_special_tokens=False)
    return out, text, trained


def test_nemotron_template_turns_images_and_loss():
    tok = nemotron_bytes()
    turns = place_images(turns_from_chat_json(LLAVA), 2)
    out, text, trained = rows(NEMOTRON, turns, [3, 2], tok)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\n<img><image><image><image></img>\nWhat is it?<|im_end|>\n"
                    "<|im_start|>assistant\nA circle.<|im_end|>\n"
                    "<|im_start|>user\nAnd <img><image><image></img>?<|im_end|>\n"
                    "<|im_start|>assistant\nA square.<|im_end|>\n")
    assert trained == "A circle.<|im_end|>A square.<|im_end|>"
    assert [out.tokens[s:s + n] for s, n in out.image_runs] == [[263] * 3, [263] * 2]


def test_documents_train_on_all_their_text_and_plain_has_no_markers():
    tok = nemotron_bytes()
    _, text, trained = rows(NEMOTRON, [Turn("document", ("Look:", IMAGE, "a dog."))], [2], tok)
    assert text == "<s>Look:<img><image><image></img>a dog.</s>" and trained == "Look:a dog.</s>"
    plain = ByteTokenizer()
    caption = conversation_of(CaptioningSample(__key__="k", __restore_key__=(), image=drawn(8, 8), caption="hi"))
    out, text, trained = rows(PLAIN, caption.turns, [4], plain)
    assert out.tokens == [259] * 4 + [10] + list(b"hi") + [plain.eos_id]
    assert trained == "hi</s>" and text == "<image><image><image><image>\nhi</s>"


def test_template_markers_must_be_single_tokens():
    with pytest.raises(ValueError, match=r"nemotron chat template needs these markers as single tokens.*'<img>' "
                                         r"\(5 tokens\)"):
        ConversationTaskEncoder(ByteTokenizer(), template=NEMOTRON, seq_length=64)


# --------------------------------------------------------------------------------------------------------------
# the cooker and the task encoder


def png(width: int, height: int, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 10)).save(out, format=fmt)
    return out.getvalue()


def crude(parts: dict) -> dict:
    return {"__key__": "s0", "__restore_key__": ("Webdataset", 0, 0, "x"), "__subflavors__": {}, **parts}


def test_the_cooker_orders_images_by_json_or_by_name():
    chat = {"messages": [{"role": "user", "content": "<image><image><image>"}, {"role": "assistant", "content": "ok"}]}
    a, b, c = drawn(10, 11), drawn(12, 13), drawn(14, 15)
    natural = cook_chat(crude({"json": chat, "img10.jpg": c, "img2.jpg": b, "img1.png": a}))
    assert [im.shape[-1] for im in natural.images] == [10, 12, 14]  # widths
    named = cook_chat(crude({"json": {**chat, "images": ["img10.jpg", "img1.png", "img2.jpg"]}, "img10.jpg": c,
                             "img2.jpg": b, "img1.png": a}))
    assert [im.shape[-1] for im in named.images] == [14, 10, 12]
    no_placeholder = {"messages": [{"role": "user", "content": "Colour?"}, {"role": "assistant", "content": "green"}]}
    webp = cook_chat(crude({"json": no_placeholder, "webp": png(9, 7, "WEBP")}))
    assert webp.turns[0] == Turn("user", (IMAGE, "Colour?")) and webp.images[0].size == (9, 7)  # opened by PIL
    assert natural.__key__ == "s0" and natural.__restore_key__ == ("Webdataset", 0, 0, "x")
    with pytest.raises(ValueError, match=r"exactly one \.json part.*\['txt'\]"):
        cook_chat(crude({"txt": "hello"}))


def chat_sample(n_images: int, answer: str = "yes") -> ChatSample:
    text = " ".join(["<image>"] * n_images) + " same?"
    turns = place_images(turns_from_chat_json({"messages": [{"role": "user", "content": text},
                                                            {"role": "assistant", "content": answer}]}), n_images)
    return ChatSample(__key__="c", __restore_key__=(), turns=turns,
                      images=[drawn(16 + 8 * i, 16) for i in range(n_images)])


def test_truncation_drops_whole_images_and_skips_what_has_nothing_to_train():
    tok = nemotron_bytes()
    mode = DynamicResolution(patch_size=8, min_patches=4, max_patches=16, pixel_shuffle_factor=4)
    full = ConversationTaskEncoder(tok, template=NEMOTRON, seq_length=512, image_mode=mode)
    whole = full.encode_sample(chat_sample(2))
    assert len(whole.images) == 2 and int((whole.tokens == 263).sum()) == sum(im.num_tokens for im in whole.images)
    # a budget that ends inside the second image's placeholders cuts before them and drops that image
    second = (whole.tokens == 263).nonzero().flatten()[-1].item()
    te = ConversationTaskEncoder(tok, template=NEMOTRON, seq_length=second, image_mode=mode)
    with pytest.raises(TooLong):  # nothing of the answer is left to train on: skipped and counted by the loader
        te.encode_sample(chat_sample(2))
    n = len(whole.tokens) - 3  # the answer's tail is cut; both images stay
    cut = ConversationTaskEncoder(tok, template=NEMOTRON, seq_length=n, image_mode=mode).encode_sample(
        chat_sample(2))
    assert len(cut.images) == 2 and torch.equal(cut.tokens, whole.tokens[:n])
    assert torch.equal(cut.loss_mask[:-1], whole.loss_mask[:n - 1]) and 0 < cut.loss_mask.sum() < whole.loss_mask.sum()
    first_image_end = (whole.tokens == 263).nonzero().flatten()[whole.images[0].num_tokens - 1].item()
    te = ConversationTaskEncoder(tok, template=NEMOTRON, seq_length=first_image_end + 3, image_mode=mode)
    with pytest.raises(TooLong, match="cut to seq_length it keeps fewer than 1 of its 4 answer tokens"):
        te.encode_sample(chat_sample(2))


def test_labels_follow_the_trained_tokens():
    tok = nemotron_bytes()
    te = ConversationTaskEncoder(tok, template=NEMOTRON, seq_length=256, image_mode=FixedTiles(16, 8))
    s = te.encode_sample(chat_sample(1, answer="red"))
    learned = s.labels[s.loss_mask > 0]
    assert tok.decode(learned, skip_special_tokens=False) == "red<|im_end|>"
    assert torch.equal(s.labels[:-1][s.loss_mask[:-1] > 0], s.tokens[1:][s.loss_mask[:-1] > 0])
    assert (s.labels[s.loss_mask == 0] == tok.pad_id).all()
