"""The task encoder for every accepted sample type: sample -> conversation -> chat template -> micro-batch rows.

Each sample becomes a `Conversation` (`sample_formats.py`; crude chat datasets are cooked first by the cooker this
encoder registers, `chat_cooker.py`), the chat template tokenizes it with each image slot expanded to that image's
token count (the image mode's tiling and pixel shuffle), and the rows carry `labels` / `loss_mask` on the tokens
the template trains (assistant turns, documents). Batching, image collation and sequence packing are
`MultimodalTaskEncoder`'s.

Too long for `seq_length`: the tail is cut; an image whose placeholders the cut reaches is dropped whole (with its
placeholders). What the cut took (tokens, answer tokens) rides with the sample into the run's counts. A sample left
with nothing to train on is skipped as too long (`skips.TooLong`: a tombstone in the loader's stream).

Before any sample is read, `build_train_datasets` (energon calls it in the main process) checks each dataset's
declared sample type and refuses an unreadable one in one line.
"""

from __future__ import annotations

import torch
from megatron.energon import stateless

from .chat_cooker import CHAT_COOKER
from .chat_template import PLAIN, ChatTemplate, RenderedConversation
from .sample_formats import check_readable, conversation_of
from .images import to_float_image
from .skips import UnsupportedSample
from .task_encoder import EncodedSample, MultimodalTaskEncoder

__all__ = ["ConversationTaskEncoder"]


class ConversationTaskEncoder(MultimodalTaskEncoder):
    """`MultimodalTaskEncoder` for captions, VQA, interleaved documents, text and multi-turn chat.

    Args (besides `MultimodalTaskEncoder`'s):
        template: the chat template (`chat_template.NEMOTRON`, `PLAIN`, ..., or a tokenizer folder's own,
            `hf_chat_template.HFChatTemplate`); its markers must be single tokens of the tokenizer.
        reader: who reads the data, for the message that refuses a dataset (e.g. the provider's name).
    """

    cookers = [CHAT_COOKER]

    def __init__(self, tokenizer, *, template: ChatTemplate = PLAIN, reader: str = "this provider", **kwargs):
        super().__init__(tokenizer, **kwargs)
        template.check_tokenizer(tokenizer)
        self.template = template
        self.reader = reader

    def build_train_datasets(self, *, datasets, **kwargs):
        for loaded in datasets:
            factory = loaded.dataset
            check_readable(factory.__sample_type__, getattr(factory, "path", "?"), self.reader)
        return super().build_train_datasets(datasets=datasets, **kwargs)

    def _truncate(self, rendered: RenderedConversation) -> tuple[RenderedConversation, int]:
        """The rendering cut to `seq_length` tokens, and how many of its images it keeps whole."""
        cut = min(len(rendered.tokens), self.seq_length)
        kept = 0
        for start, length in rendered.image_runs:
            if start + length > cut:
                cut = min(cut, start)  # never half an image: drop it and what follows
                break
            kept += 1
        return RenderedConversation(rendered.tokens[:cut], rendered.trained[:cut], rendered.image_runs[:kept]), kept

    @stateless
    def encode_sample(self, sample) -> EncodedSample:
        conversation = conversation_of(sample)
        images = [to_float_image(im) for im in conversation.images]
        counts = [self.image_mode.num_tokens(im.shape[-2], im.shape[-1]) for im in images]
        whole = self.template.render(conversation.turns, counts, self.tokenizer)
        rendered, kept = self._truncate(whole)
        # position i learns token i + 1: the first token is never a target
        if sum(rendered.trained[1:]) < self.min_text_tokens:
            if sum(whole.trained[1:]) < self.min_text_tokens:  # not the cut: nothing to learn at any length
                raise UnsupportedSample("the conversation has no tokens to train on (no answer)")
            self._skip(len(whole.tokens), f"cut to seq_length it keeps fewer than {self.min_text_tokens} of its "
                                          f"{sum(whole.trained[1:])} answer tokens")
        self._check_image_budget(sum(counts[:kept]), len(whole.tokens))
        processed = [self.image_mode.process(im) for im in images[:kept]]
        assert [p.num_tokens for p in processed] == counts[:kept]
        tokens = torch.tensor(rendered.tokens, dtype=torch.long)
        loss_mask = torch.zeros(len(tokens), dtype=torch.float32)
        loss_mask[:-1] = torch.tensor(rendered.trained[1:], dtype=torch.float32)
        labels = torch.full_like(tokens, self.tokenizer.pad_id)
        labels[:-1] = tokens[1:]
        labels = labels.masked_fill(loss_mask == 0, self.tokenizer.pad_id)
        out = self._encoded(sample, tokens, labels, loss_mask, processed)
        return self._with_cut(out, len(whole.tokens), sum(whole.trained[1:]))
