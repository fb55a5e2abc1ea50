"""The files beside an exported omni model's weights that transformers' `AutoProcessor` reads, so that the folder
runs with transformers alone: the tokenizer (`tokenizer.json`, `tokenizer_config.json`), the chat template, the
processor's config (image, video and audio sub-processors, as `NemotronH_Omni_Reasoning_V3Processor` takes them)
and the generation config.

The tokenizer is the one mimo trained with: `tokenizer_path`'s, with the chat template's markers and `<image>`
added as mimo adds them; without one, UTF-8 bytes as mimo's ByteTokenizer numbers them (a BPE of the 256 byte
tokens with byte fallback and no merges, then pad, bos, eos, the template's markers and `<image>`), so that the
exported model reads the same ids it was trained on.
"""

from __future__ import annotations

import json

from ..tokens import image_token_id, template_of, tokenizer_of

IMAGE_TOKEN = "<image>"
# NEMOTRON as Jinja: content a string, or parts [{type: text | image}], an image part one <image> that the
# processor expands into <img>, the image's placeholders and </img>.
NEMOTRON_JINJA = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN_JINJA = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}")


def processor_files(s, frames: int | None = None) -> dict[str, str]:
    """{file name: text} for settings `s`; `frames`: the exported video embedder's frames per patch."""
    template = template_of(s)
    tokenizer = tokenizer_of(s)
    if tokenizer is None:
        backend, names = _byte_tokenizer(s, template.special_tokens)
    else:
        backend = tokenizer.backend
        names = {"pad": backend.id_to_token(tokenizer.pad_id), "eos": backend.id_to_token(tokenizer.eos_id),
                 "bos": None if tokenizer.bos_id is None else backend.id_to_token(tokenizer.bos_id)}
    # The model ends an answer with the template's marker (NEMOTRON's <|im_end|>, a folder template's end of turn)
    # where it is one token, else with the tokenizer's eos.
    end = template.answer_end
    stop = end if end and len(backend.encode(end, add_special_tokens=False).ids) == 1 else names["eos"]
    frames = frames or (s.video_temporal_patch_size if s.video_temporal_patch_size > 1 else 2)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": stop, "pad_token": names["pad"],
                        "bos_token": names["bos"], "image_token": IMAGE_TOKEN, "model_max_length": s.seq_length,
                        "extra_special_tokens": {"image_token": IMAGE_TOKEN}}
    image = {"image_processor_type": "NemotronH_Omni_Reasoning_V3ImageProcessor", "patch_size": s.patch_size,
             "downsample_ratio": 0.5, "min_num_patches": s.min_patches, "max_num_patches": s.max_patches,
             "max_model_len": _max_model_len(s), "image_mean": list(s.image_mean), "image_std": list(s.image_std)}
    video = {"video_processor_type": "NemotronH_Omni_Reasoning_V3VideoProcessor", "patch_size": s.patch_size,
             "image_mean": list(s.image_mean), "image_std": list(s.image_std)}
    processor = {"processor_class": "NemotronH_Omni_Reasoning_V3Processor", "video_temporal_patch_dim": frames,
                 "image_processor": image, "video_processor": video,
                 "feature_extractor": {"feature_extractor_type": "ParakeetFeatureExtractor"}}
    stops = list(dict.fromkeys(backend.token_to_id(t) for t in (stop, names["eos"])))
    generation = {"eos_token_id": stops, "pad_token_id": backend.token_to_id(names["pad"])}
    return {"tokenizer.json": backend.to_str(), "tokenizer_config.json": _json(tokenizer_config),
            "chat_template.jinja": _jinja(template),
            "processor_config.json": _json(processor), "generation_config.json": _json(generation)}


def _jinja(template) -> str:
    """The template as Jinja: a tokenizer folder's own as it is, the hand-written ones as written above."""
    source = getattr(template, "source", None)  # HFChatTemplate
    return source if source is not None else NEMOTRON_JINJA if template.name == "nemotron" else PLAIN_JINJA


def _max_model_len(s) -> int:
    """The processor's context length: it caps every image's patches at (max_model_len - 4) x 4, which must not cut
    below max_patches, the cap mimo trained with (a seq_length only just above max_patches / 4 would)."""
    return max(s.seq_length, -(-s.max_patches // s.shuffle_factor) + 4)


def _byte_tokenizer(s, markers):
    """A `tokenizers` tokenizer that encodes as mimo's ByteTokenizer: ids 0-255 the UTF-8 bytes, pad 256, bos 257,
    eos 258, the template's markers, and `<image>` at the model's image token id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    from mimo.plugins.data import ByteTokenizer

    byte_tokenizer = ByteTokenizer(vocab_size=s.vocab_size, special_tokens=markers)
    specials = {"<pad>": byte_tokenizer.pad_id, "<s>": byte_tokenizer.bos_id, "</s>": byte_tokenizer.eos_id,
                **byte_tokenizer.extra_ids, IMAGE_TOKEN: image_token_id(s)}
    vocab = {f"<0x{b:02X}>": b for b in range(ByteTokenizer.NUM_BYTES)}
    vocab.update(specials)  # in the model's vocabulary at mimo's ids, so the added tokens below keep them
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token=None))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return backend, {"pad": "<pad>", "bos": "<s>", "eos": "</s>"}


def _json(data: dict) -> str:
    return json.dumps(data, indent=2) + "\n"
