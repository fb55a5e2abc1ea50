"""Prompts to answer: a question typed with its images, or the answer turns of an energon dataset, and how a prompt
becomes a model's input through its prompt format (tokenizer, chat template, image mode).

A dataset's samples become conversations exactly as training reads them (`sample_formats.conversation_of`, crude
chat datasets cooked by the same cooker, blends as the metadataset names them); each assistant turn is one prompt:
the turns before it (earlier answers as the dataset gives them) and its images, with the turn's text as the
reference answer. A document (interleaved text and images, plain text) has no answer turn: it is one continuation
prompt instead, the document up to its last text (or, a single text, up to the middle of its words) with the images
there, and the rest of its text as the reference. Samples with neither are counted. The split is read in its stored
order, without shuffling or repetition, so the same prompts come every time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from mimo.errors import UsageError

from .conversation import IMAGE_PLACEHOLDER, Turn, place_images, split_placeholders
from .images import to_float_image

__all__ = ["EncodedPrompt", "Prompt", "encode", "from_dataset", "from_text", "read_image"]


@dataclass
class Prompt:
    turns: list[Turn]  # the conversation so far; the model writes the next assistant turn
    images: list = field(default_factory=list)  # float [3, H, W] images, one per image slot of the turns
    reference: str | None = None  # the dataset's answer
    key: str = ""  # the dataset sample's key, and which of its answers (#n)

    @property
    def question(self) -> str:
        """The last user turn's text (what a reader of the output wants to see)."""
        user = [t for t in self.turns if t.role == "user"] or self.turns
        if not user:
            return ""
        return "".join(p if isinstance(p, str) else IMAGE_PLACEHOLDER for p in user[-1].parts).strip()


@dataclass
class EncodedPrompt:
    input_ids: torch.Tensor  # [1, L]: the rendered conversation and the assistant's header
    modality_inputs: dict  # {modality: {encoder: input}}, empty without images
    position_ids: torch.Tensor | None = None  # [A, 1, L] from the prompt format's positions hook; None: 0 .. L-1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def read_image(path: Path):
    """An image file as float [3, H, W] in [0, 1]; one line when it cannot be read."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return to_float_image(image.convert("RGB"))
    except FileNotFoundError:
        raise UsageError(f"--image {path}: no such file") from None
    except (UnidentifiedImageError, OSError) as err:
        raise UsageError(f"--image {path}: not an image PIL can read ({err})") from None


def from_text(text: str, image_paths=(), system: str | None = None) -> Prompt:
    """One user turn: `text`, with the images at its `<image>` placeholders (else before it, as LLaVA does)."""
    images = [read_image(Path(p)) for p in image_paths]
    turns = ([Turn("system", (system,))] if system else []) + [Turn("user", tuple(split_placeholders(text)))]
    try:
        turns = place_images(turns, len(images))
    except ValueError as err:
        raise UsageError(f"--prompt: {err} (--image)") from None
    return Prompt(turns, images)


def _answer_prompts(key: str, conversation) -> Iterator[Prompt]:
    turns, used = conversation.turns, 0
    for n, turn in enumerate(turns):
        if turn.role == "assistant":
            reference = "".join(p for p in turn.parts if isinstance(p, str))
            yield Prompt(list(turns[:n]), conversation.images[:used], reference, f"{key}#{n}")
        used += turn.num_images


def _continuation_prompt(key: str, conversation) -> Prompt | None:
    """A document's beginning to continue, with the rest of its text as the reference; None when too short."""
    turns = conversation.turns
    if not turns or turns[-1].role != "document":
        return None
    parts = list(turns[-1].parts)
    texts = [i for i, p in enumerate(parts) if isinstance(p, str) and p.strip()]
    if len(texts) >= 2:  # the document up to its last text, that text the reference
        head, reference = parts[:texts[-1]], parts[texts[-1]]
    elif texts:  # one text: cut between words, half each side
        words = parts[texts[0]].split(" ")
        if len(words) < 2:
            return None
        half = len(words) // 2
        head = parts[:texts[0]] + [" ".join(words[:half]) + " "]
        reference = " ".join(words[half:])
    else:
        return None
    used = sum(t.num_images for t in turns[:-1]) + sum(not isinstance(p, str) for p in head)
    return Prompt(list(turns[:-1]) + [Turn("document", tuple(head))], conversation.images[:used],
                  reference.strip(), f"{key}#continue")


def _prompts_of(key: str, conversation) -> list[Prompt]:
    answers = list(_answer_prompts(key, conversation))
    if answers:
        return answers
    continuation = _continuation_prompt(key, conversation)
    return [continuation] if continuation else []


def from_dataset(path: Path, split: str = "val", limit: int | None = None) -> tuple[list[Prompt], int]:
    """The first `limit` answer prompts of `path`'s `split` (all when None), and how many samples had none."""
    from megatron.energon import DefaultTaskEncoder, WorkerConfig, get_loader, get_val_dataset, stateless

    from .chat_cooker import CHAT_COOKER
    from .check import check_dataset
    from .sample_formats import check_readable, conversation_of

    class Conversations(DefaultTaskEncoder):
        cookers = [CHAT_COOKER]  # crude chat datasets (as `mimo data convert` writes them) read as in training

        @stateless
        def encode_sample(self, sample):
            return getattr(sample, "__key__", "?"), conversation_of(sample)

        def build_val_datasets(self, *, datasets, **kwargs):  # get_val_dataset's way in, blends included
            for loaded in datasets:
                check_readable(loaded.dataset.__sample_type__, getattr(loaded.dataset, "path", path), "mimo generate")
            return super().build_val_datasets(datasets=datasets, **kwargs)

        def batch(self, samples):
            return samples

    check_dataset(path)  # a JSON file or a class that cannot be imported: one line naming the way out
    try:
        dataset = get_val_dataset(str(path), split_part=split, batch_size=1, task_encoder=Conversations(),
                                  worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    except UsageError:
        raise
    except Exception as err:  # noqa: BLE001 - energon's many ways of saying the folder is not a dataset
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise UsageError(f"--data {path}: cannot read its {split} split ({first})") from None
    prompts, without_answer = [], 0
    for batch in get_loader(dataset):
        for key, conversation in batch:
            found = _prompts_of(key, conversation)
            without_answer += not found
            prompts += found
            if limit is not None and len(prompts) >= limit:
                return prompts[:limit], without_answer
    if not prompts:
        raise UsageError(f"--data {path}: its {split} split has no sample with an answer turn or a document to "
                         f"continue")
    return prompts, without_answer


def encode(prompt: Prompt, prompt_format) -> EncodedPrompt:
    """The prompt as the model's input: the chat template's rendering with each image's placeholders (its image
    mode's count), the assistant's header, and the encoder input of the images."""
    fmt = prompt_format
    if prompt.images and fmt.image_mode is None:
        raise UsageError("this model reads no images (its prompt format has no image mode)")
    images = [to_float_image(im) for im in prompt.images]
    counts = [fmt.image_mode.num_tokens(im.shape[-2], im.shape[-1]) for im in images]
    ids = fmt.template.generation_prompt(prompt.turns, counts, fmt.tokenizer)
    modality_inputs, processed = {}, [fmt.image_mode.process(im) for im in images]
    if images:
        modality_inputs = {fmt.modality: {fmt.encoder: fmt.image_mode.collate(processed)}}
    input_ids = torch.tensor([ids], dtype=torch.long)
    positions = None if fmt.positions is None else fmt.positions(input_ids[0], processed)[:, None]
    return EncodedPrompt(input_ids, modality_inputs, positions)
