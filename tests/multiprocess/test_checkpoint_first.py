"""What a command says first about a checkpoint folder: `mimo eval`/`mimo generate --load` on a folder without one
name it (and how one is made) before asking for --provider; a refused `mimo run` leaves no --save folder behind;
an unreadable common.pt gives torch's reason in words, not escapes or half a word."""

from __future__ import annotations

import torch

import pytest

from helpers import run_mimo
from mimo.core.checkpoint.layout import first_words, read_common
from mimo.errors import UsageError


@pytest.mark.parametrize("command", [["eval"], ["generate", "--prompt", "hi"]])
def test_load_without_a_checkpoint_is_named_before_the_provider(tmp_path, command):
    result = run_mimo(*command, "--load", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: --load {tmp_path}: no checkpoint there (latest_checkpointed_iteration"
                                     f".txt is missing); a checkpoint is what `mimo run --save DIR` writes (`mimo "
                                     f"ckpt import-hf HF_DIR DIR` makes one from Hugging Face weights)")


def test_a_refused_run_leaves_no_save_folder(tmp_path):
    save = tmp_path / "runs" / "new"
    result = run_mimo("run", "--provider", "mock-vlm", "--load", str(tmp_path / "typo"), "--save", str(save),
                      "--metrics-file", str(tmp_path / "logs" / "m.jsonl"))
    assert result.returncode == 2 and "--load" in result.stderr and "no such directory" in result.stderr
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))


class NotPlainData:  # what a weights-only load refuses
    pass


def test_unreadable_common_pt_gives_the_reason_in_whole_words(tmp_path):
    torch.save({"run": NotPlainData()}, tmp_path / "common.pt")
    with pytest.raises(UsageError) as err:
        read_common(tmp_path)
    message = str(err.value)
    assert "\x1b" not in message and "\n" not in message
    assert "Unsupported global" in message and "NotPlainData" in message


def test_a_long_reason_is_cut_between_words():
    words = [f"word{i}" for i in range(100)]
    cut = first_words(RuntimeError(" ".join(words) + "\nsecond line"), limit=60)
    assert cut.endswith(" ...") and len(cut) <= 64
    assert all(word in words for word in cut[:-4].split())
