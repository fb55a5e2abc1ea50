"""The Nemotron family's `chat_template` setting: `auto` (the default) renders a tokenizer folder's own Jinja
template where the folder has one, else the hand-written Nemotron VL format. The folder here is the one `mimo ckpt
export-hf` writes beside the weights (its tokenizer, and the Nemotron template as Jinja): read back through its own
template, every conversation gives the ids, trained tokens and image runs the hand-written template gave in
training, so the losses stay as they were."""

from __future__ import annotations

import json

import pytest

from mimo.data import NEMOTRON, HFChatTemplate, Turn
from mimo.data.conversation import IMAGE
from mimo.errors import UsageError
from mimo.providers.nemotron import TINY, NemotronVLMSettings
from mimo.providers.nemotron.hf.processor import NEMOTRON_JINJA, processor_files
from mimo.providers.nemotron.tokens import data_tokenizer, template_of

pytest.importorskip("transformers")

CONVERSATIONS = [
    ([Turn("user", (IMAGE,)), Turn("assistant", ("A red circle on a white background.",))], [5]),
    ([Turn("system", ("Be brief.",)), Turn("user", (IMAGE, "What colour is it? ", IMAGE)),
      Turn("assistant", ("Red and blue.",)), Turn("user", ("Sure?",)), Turn("assistant", ("Yes.",))], [3, 4]),
    ([Turn("user", ("Say hi.",)), Turn("assistant", ("Hi – ünïcode ✓",))], []),
    ([Turn("document", ("An interleaved ", IMAGE, " document."))], [2]),
]


@pytest.fixture
def exported(tmp_path):
    """The tokenizer files export-hf writes for a model trained without tokenizer_path (UTF-8 bytes)."""
    settings = NemotronVLMSettings(**TINY)
    folder = tmp_path / "hf"
    folder.mkdir()
    for name, text in processor_files(settings).items():
        (folder / name).write_text(text)
    return settings, folder


def test_auto_reads_the_folders_own_template_with_the_hand_written_ones_tokens_and_losses(exported):
    trained_with, folder = exported
    assert (folder / "chat_template.jinja").read_text() == NEMOTRON_JINJA
    settings = NemotronVLMSettings(**{**TINY, "tokenizer_path": str(folder)})
    template = template_of(settings)
    assert isinstance(template, HFChatTemplate) and template.answer_end == "<|im_end|>"
    assert template_of(trained_with) is NEMOTRON  # no tokenizer folder: the hand-written template
    hf_tok, byte_tok = data_tokenizer(settings), data_tokenizer(trained_with)
    assert hf_tok.image_token_id == byte_tok.image_token_id
    for turns, counts in CONVERSATIONS:
        ours, theirs = template.render(turns, counts, hf_tok), NEMOTRON.render(turns, counts, hf_tok)
        assert (ours.tokens, ours.trained, ours.image_runs) == (theirs.tokens, theirs.trained, theirs.image_runs)
        if turns[0].role != "document":  # the export names <|im_end|> its eos, which ends a document now
            assert ours.tokens == NEMOTRON.render(turns, counts, byte_tok).tokens  # the ids trained on
        asked = turns[:-1] if turns[-1].role == "assistant" else turns
        asked_counts = counts[:sum(t.num_images for t in asked)]
        assert template.generation_prompt(asked, asked_counts, hf_tok) == NEMOTRON.generation_prompt(
            asked, asked_counts, hf_tok)
    assert template.stop_ids(hf_tok) == NEMOTRON.stop_ids(hf_tok) == {hf_tok.encode("<|im_end|>")[0]}
    # an export of a model trained so writes the folder's own template again
    assert processor_files(settings)["chat_template.jinja"] == NEMOTRON_JINJA


def test_the_hand_written_template_where_the_folder_has_none_or_it_is_asked_for(exported):
    _, folder = exported
    own = NemotronVLMSettings(**{**TINY, "tokenizer_path": str(folder), "chat_template": "tokenizer"})
    assert isinstance(template_of(own), HFChatTemplate)
    chosen = NemotronVLMSettings(**{**TINY, "tokenizer_path": str(folder), "chat_template": "nemotron"})
    assert template_of(chosen) is NEMOTRON
    (folder / "chat_template.jinja").unlink()
    bare = NemotronVLMSettings(**{**TINY, "tokenizer_path": str(folder)})
    assert template_of(bare) is NEMOTRON
    with pytest.raises(UsageError, match="has no chat template"):
        template_of(own)


def test_a_template_that_cannot_render_is_one_line_naming_the_folder(exported):
    _, folder = exported
    (folder / "chat_template.jinja").write_text("{{ raise_exception('Only user turns, please') }}")
    settings = NemotronVLMSettings(**{**TINY, "tokenizer_path": str(folder)})
    with pytest.raises(UsageError, match=rf"chat template of {folder} cannot render .*: Only user turns, please"):
        template_of(settings)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>"  # the export's stop
