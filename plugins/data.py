"""Reading `--data` in a provider: the shared pieces, for `data_provider` to put together.

    from mimo.plugins.data import ByteTokenizer, ConversationTaskEncoder, FixedTiles, chat_template

    @hookimpl
    def data_provider(settings, ctx):
        if ctx.data_path:
            template = chat_template("nemotron")
            tokenizer = ByteTokenizer(special_tokens=template.special_tokens)   # or load_hf_tokenizer(folder, ...)
            encoder = ConversationTaskEncoder(tokenizer, template=template, seq_length=settings.seq_length,
                                              image_mode=FixedTiles(image_size=224, patch_size=14),
                                              modality="images", encoder_name="vit", reader="my-vlm")
            return ctx.energon_loader(encoder)
        ...

A tokenizer folder's own Jinja chat template instead of a hand-written one: `select_chat_template(name,
tokenizer_path, default="nemotron", image=ImageMarkers("<image>", "<img>", "</img>"))` for a `chat_template`
setting of `tokenizer` or `auto` (the folder's own template where it has one, else `default`); `ImageMarkers` says
what the template writes for an image and what mimo puts around the image's placeholders.

`ConversationTaskEncoder` reads every sample type in docs/data.md (captions, VQA, interleaved, text, crude chat
datasets through the cooker it registers) and refuses the others before training starts; the chat template
marks what is trained; the image mode decides each image's token count. `ctx.energon_loader` gives the loop's
lane loader (lanes, worker routing, resumable state and skip counts stay mimo's).
"""

from mimo.data import (
    CHAT_TEMPLATES, NEMOTRON, PLAIN, ByteTokenizer, ChatTemplate, ConversationTaskEncoder, DynamicResolution,
    FixedTiles, HFChatTemplate, HFTokenizer, ImageMarkers, Tokenizer, chat_template, clip_tokens, clip_tubelets,
    collate_clips, concat_clips, load_hf_chat_template, load_hf_tokenizer, readable_type_names, select_chat_template,
    sequence_grids,
)
from mimo.data.skips import TooLong

__all__ = [
    "CHAT_TEMPLATES", "NEMOTRON", "PLAIN", "ByteTokenizer", "ChatTemplate", "ConversationTaskEncoder",
    "DynamicResolution", "FixedTiles", "HFChatTemplate", "HFTokenizer", "ImageMarkers", "Tokenizer", "chat_template",
    "clip_tokens", "clip_tubelets", "collate_clips", "concat_clips", "load_hf_chat_template", "load_hf_tokenizer",
    "readable_type_names", "select_chat_template", "sequence_grids", "TooLong",
]
