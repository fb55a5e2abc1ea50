"""The Qwen3.5 VLM trains on chats in its tokenizer folder's own Jinja template (`tokenizer_path`,
`chat_template=auto`: transformers' `apply_chat_template` renders them), with the loss on the assistant turns
alone: each answer and its `<|im_end|>`, never a system or user turn, the template's default system turn or an
image placeholder; images as `<|vision_start|><|image_pad|>...<|vision_end|>`, one `<|image_pad|>` per merged token."""

from __future__ import annotations

import random

from format_datasets import build_chat
from mimo.plugins import DataContext
from test_hf_chat_template import CHATML, backend, folder_with  # noqa: F401 (backend: a byte-level BPE fixture)


def test_a_chat_dataset_trains_on_the_assistant_turns_of_the_folders_template(tmp_path, backend):
    from mimo.providers import qwen35

    expected = build_chat(tmp_path / "chat", random.Random(7))
    folder = folder_with(tmp_path, backend, "qwen", CHATML)
    settings = qwen35.Qwen35Settings(**{**qwen35.TINY, "vocab_size": 400, "tokenizer_path": str(folder),
                                        "seq_length": 512, "shuffle_buffer": 0})
    ctx = DataContext(micro_batch_size=2, num_microbatches=1, num_lanes=1, seed=0, data_path=str(tmp_path / "chat"))
    loader = qwen35.data_provider(settings=settings, ctx=ctx)
    tok = qwen35.prompt_format(settings).tokenizer
    seen = {}
    try:
        while len(seen) < len(expected) - 3:  # three samples hold a 3 x 700 image, which Qwen's processor refuses
            batch = next(loader)
            for r, (_, _, _, key) in enumerate(loader.last_rows):
                seen[key] = (batch["input_ids"][r], batch["labels"][r], batch["loss_mask"][r])
    finally:
        loader.close()
    for key, (ids, labels, mask) in seen.items():
        want = expected[key]
        text = tok.decode(ids, skip_special_tokens=False)
        trained = tok.decode(labels[mask > 0], skip_special_tokens=False)
        assert trained == "".join(f"{answer}<|im_end|>" for answer in want["answers"]), (key, trained)
        system = want["chat"].get("system") or next((m["content"] for m in want["chat"].get("messages", ())
                                                     if m["role"] == "system"), "You are a helpful assistant.")
        assert text.startswith(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"), (key, text)
        images = len(want["images"])
        assert text.count("<|vision_start|>") == text.count("<|vision_end|>") == images, (key, text)
        assert int((ids == tok.image_token_id).sum()) == sum(
            settings.image_mode().num_tokens(h, w) for h, w in want["images"])
