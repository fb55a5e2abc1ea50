"""Data for the Qwen3.5 family: synthetic caption-like text (the language model alone, until the vision tower feeds
images), and the prompt format generation renders prompts in.

Each of `num_classes` classes has a fixed caption of CAPTION_TOKENS random tokens. A sample is its class's marker
token followed by the caption, repeated to fill `seq_length`: the first caption token is predictable only from
the marker, the rest from the caption seen so far, so the loss falls as the model learns the captions and to
copy. Sample `i` depends only on (seed, i), so every layout reads the same global batch.
"""

from __future__ import annotations

import torch

from mimo.errors import UsageError

from .settings import Qwen35Settings

_TASK_SEED = 1234  # the task (captions) is fixed; the run's seed picks the samples
CAPTION_TOKENS = 16


def captions(s: Qwen35Settings) -> torch.Tensor:
    """[num_classes, CAPTION_TOKENS] caption ids, above the class markers (ids 0 .. num_classes - 1)."""
    gen = torch.Generator().manual_seed(_TASK_SEED)
    return torch.randint(s.num_classes, s.vocab_size, (s.num_classes, CAPTION_TOKENS), generator=gen)


def sample(s: Qwen35Settings, task: torch.Tensor, seed: int, index: int) -> torch.Tensor:
    """seq_length + 1 token ids: the class marker, then its caption repeated."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    label = int(torch.randint(s.num_classes, (1,), generator=gen))
    repeats = s.seq_length // CAPTION_TOKENS + 1
    return torch.cat([torch.tensor([label]), task[label].repeat(repeats)])[: s.seq_length + 1]


def collate(s: Qwen35Settings, rows: list[torch.Tensor]) -> dict:
    tokens = torch.stack(rows)
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return {
        "input_ids": input_ids, "labels": labels, "loss_mask": torch.ones(labels.shape),
        # text positions; with images, Qwen's 3-D positions [3, B, S] (layers.InterleavedMRoPE takes both)
        "position_ids": torch.arange(s.seq_length).expand_as(input_ids).contiguous(),
        "modality_inputs": {},
    }


def synthetic_batches(s: Qwen35Settings, ctx):
    task = captions(s)
    for indices in ctx.sample_indices():
        yield collate(s, [sample(s, task, ctx.seed, i) for i in indices])


def prompt_format(s: Qwen35Settings):
    """Text prompts for `mimo generate` (images come with the vision tower's image mode): the `tokenizer_path`
    tokenizer, else UTF-8 bytes, in the `chat_template` setting's template (a Qwen folder's own ChatML template
    where it has one)."""
    from mimo import PromptFormat
    from mimo.plugins.data import ByteTokenizer, ImageMarkers, load_hf_tokenizer, select_chat_template

    # Qwen's template writes <|vision_start|><|image_pad|><|vision_end|>: the placeholder is repeated in place
    template = select_chat_template(s.chat_template, s.tokenizer_path, default="plain",
                                    image=ImageMarkers("<|image_pad|>"))
    if s.tokenizer_path is not None:
        tokenizer = load_hf_tokenizer(s.tokenizer_path, image_token="<|image_pad|>",
                                      special_tokens=template.special_tokens)
        what = f"the tokenizer at {s.tokenizer_path}"
    else:
        tokenizer, what = ByteTokenizer(special_tokens=template.special_tokens), "UTF-8 bytes"
    if tokenizer.vocab_size > s.vocab_size:
        raise UsageError(f"{what} take {tokenizer.vocab_size} token ids, more than vocab_size {s.vocab_size}: --set "
                         f"vocab_size={tokenizer.vocab_size} or more, or --set tokenizer_path=DIR")
    if s.tokenizer_path is None:  # sized to the vocabulary, as the output layer is
        tokenizer = ByteTokenizer(vocab_size=s.vocab_size, special_tokens=template.special_tokens)
    template.check_tokenizer(tokenizer)
    return PromptFormat(tokenizer, template)


def data_provider(s: Qwen35Settings, ctx):
    if ctx.data_path:
        raise UsageError("the qwen3.5-vl providers train on synthetic text only for now (no --data yet: it comes "
                         "with the vision tower's image mode); leave --data out")
    return synthetic_batches(s, ctx)
