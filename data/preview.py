"""`mimo data preview`: the first samples of a dataset as a provider's task encoder hands them to the model, one
turn a line (wrapped to 80 columns): its role, its text as the encoder's tokens decode (the chat template's
markers included), each image as `<image 640x480: 768 patches, 192 tokens>` in its place, and the tokens that
carry loss between `[[` and `]]` (also coloured where the terminal shows colour). What `seq_length` cuts off is
said where the cut falls; a sample the encoder skips says why.

The lines come from the encoder's own output (`SampleView.encoded`: tokens and loss mask); the chat template only
says where each turn's tokens begin. Without an encoder: the turns' text and images as read.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from .conversation import ImageSlot
from .sample_view import SampleView
from .skips import REASONS

__all__ = ["OPEN", "CLOSE", "preview_lines", "turn_lengths"]

WIDTH = 80
LABEL = 11  # the role column
OPEN, CLOSE = "[[", "]]"  # around the tokens that carry loss
NBSP = "\xa0"  # keeps an image's description on one line
BREAK = "\x00"  # where a line may break without a space: after a line break's `\\n`, around an image


def _escaped(text: str) -> str:
    """Text with its line breaks and other control characters written visibly (`\\n`), one line."""
    return "".join(ch if ch.isprintable() or ch == " " else repr(ch)[1:-1] + (BREAK if ch == "\n" else "")
                   for ch in text)


def _shortened(text: str, chars: int) -> str:
    if chars <= 0 or len(text) <= chars:
        return text
    head = max(1, chars * 2 // 3)
    return f"{text[:head]} ... {text[len(text) - (chars - head):]}"


def _image(view: SampleView, k: int) -> str:
    width, height = view.image_sizes[k] if k < len(view.image_sizes) else ("?", "?")
    parts = [f"<image {width}x{height}"]
    if k < len(view.image_tokens):
        patches = view.image_patches[k] if k < len(view.image_patches) else None
        parts.append((f": {patches:,} patches, " if patches is not None else ": ") + f"{view.image_tokens[k]:,} tokens")
    return BREAK + ("".join(parts) + ">").replace(" ", NBSP) + BREAK


def _decode(tokenizer, ids: list[int]) -> str:
    try:
        return tokenizer.decode(ids, skip_special_tokens=False)  # the template's markers shown
    except TypeError:  # a tokenizer whose decode takes the ids alone
        return tokenizer.decode(ids)


def turn_lengths(encoder, view: SampleView) -> list[int] | None:
    """Each turn's tokens in the encoder's rendering of the whole sample (its chat template, turn by turn), or None
    when the encoder has no template or the turns do not add up to the sample's length."""
    template = getattr(encoder, "template", None)
    if template is None or not view.turns:
        return None
    counts, lengths = iter(view.image_tokens), []
    for turn in view.turns:
        mine = [next(counts) for part in turn.parts if isinstance(part, ImageSlot)]
        try:
            lengths.append(len(template.render([turn], mine, encoder.tokenizer).tokens))
        except ValueError:  # a tokenizer's own template may refuse a turn alone (e.g. an answer with no question)
            return None
    return lengths if sum(lengths) == view.needed_tokens else None


class _Tokens:
    """Renders spans of an encoded sample's tokens: text decoded, trained runs marked, images described."""

    def __init__(self, encoder, view: SampleView, chars: int):
        e = view.encoded
        self.view, self.tokenizer, self.chars = view, encoder.tokenizer, chars
        self.image_id = encoder.tokenizer.image_token_id
        self.tokens = e.tokens.tolist()
        mask = e.loss_mask.tolist()
        self.trained = [False] + [bool(m) for m in mask[:-1]]  # position i is learned when i - 1 predicts it
        self.next_image = 0

    def text(self, start: int, end: int) -> str:
        out, i = [], start
        while i < end:
            if self.tokens[i] == self.image_id and self.next_image < len(self.view.image_tokens):
                out.append(_image(self.view, self.next_image))
                i += self.view.image_tokens[self.next_image]
                self.next_image += 1
                continue
            j = i
            while j < end and self.tokens[j] != self.image_id and self.trained[j] == self.trained[i]:
                j += 1
            j = max(j, i + 1)
            piece = _shortened(_escaped(_decode(self.tokenizer, self.tokens[i:j])), self.chars)
            out.append(f"{OPEN}{piece}{CLOSE}" if self.trained[i] else piece)
            i = j
        return "".join(out)


def _turn_text(turn, view: SampleView, first_image: int, chars: int) -> tuple[str, int]:
    """A turn's text as read (no encoder), with its images described; the next image's index."""
    out, k = [], first_image
    for part in turn.parts:
        if isinstance(part, ImageSlot):
            out.append(_image(view, k))
            k += 1
        else:
            out.append(_shortened(_escaped(part), chars))
    return "".join(out), k


def _wrapped(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width`, broken at spaces and BREAKs (a longer word is cut)."""
    lines, line = [], ""
    for piece in re.split(f"( |{BREAK})", text):
        if piece in ("", BREAK):
            continue
        if piece == " ":
            if line and len(line) < width:
                line += " "
            continue
        while len(line) + len(piece) > width:
            if line.strip():
                lines.append(line.rstrip())
                line = ""
            elif len(piece) > width:
                lines.append(piece[:width])
                piece = piece[width:]
            else:
                break
        line += piece
    return lines + [line.rstrip()] if line.strip() or not lines else lines


def _row(label: str, text: str) -> list[str]:
    return [f"  {(label if n == 0 else ''):<{LABEL}}{line.replace(NBSP, ' ')}"
            for n, line in enumerate(_wrapped(text, WIDTH - 2 - LABEL))]


def _header(number: int, view: SampleView, members: list[str]) -> list[str]:
    where = f"{members[view.member]}/" if len(members) > 1 else ""
    head = f"sample {number}" + (f" ({view.kind})" if view.kind else "") + f": {where}{view.shard or '?'} key {view.key}"
    out = [head[:WIDTH]]
    if view.encoded is not None:
        e = view.encoded
        trained = int(e.loss_mask.sum())
        cut = f", seq_length cuts {e.cut_tokens}" if e.cut_tokens else ""
        images = len(view.image_sizes)
        out.append(f"  {images} image{'' if images == 1 else 's'}, {view.needed_tokens:,} tokens, {trained:,} "
                   f"trained{cut}")
    return out


def sample_lines(number: int, view: SampleView, encoder=None, members=(), chars: int = 200) -> list[str]:
    """The lines of one sample (`number` counts from 1)."""
    out = _header(number, view, list(members))
    if view.skipped is not None:
        r = view.skipped
        out += [f"  {line}" for line in textwrap.wrap(f"skipped ({REASONS.get(r.reason, r.reason)}): {r.error}",
                                                      WIDTH - 2)]
    if view.encoded is None or encoder is None:
        k = 0
        for turn in view.turns:
            text, k = _turn_text(turn, view, k, chars)
            out += _row(turn.role, text)
        return out
    tokens = _Tokens(encoder, view, chars)
    kept = len(tokens.tokens)
    lengths = turn_lengths(encoder, view) or [kept]
    roles = [t.role for t in view.turns] if len(lengths) == len(view.turns) else ["tokens"]
    start = 0
    for role, length in zip(roles, lengths):
        if start >= kept:
            break
        out += _row(role, tokens.text(start, min(start + length, kept)))
        start += length
    e = view.encoded
    if e.cut_tokens:
        out += _row("", f"(cut here by seq_length {encoder.seq_length}: {e.cut_tokens:,} more tokens, "
                        f"{e.cut_answer_tokens:,} of them trained, are not seen)")
    return out


def preview_lines(views, encoder=None, provider: str | None = None, members=(), chars: int = 200) -> list[str]:
    """Every sample's lines, after a line saying how to read them."""
    names = [Path(m).name for m in members]
    if encoder is not None:
        template = getattr(getattr(encoder, "template", None), "name", None)
        how = f"provider {provider}" + (f", {template} template" if template else "")
        out = textwrap.wrap(f"{how}, seq_length {encoder.seq_length}: {OPEN}...{CLOSE} marks the tokens that carry "
                            f"loss", WIDTH)
    else:
        out = textwrap.wrap("as read (give --provider NAME for the tokens, patches and loss the model sees)", WIDTH)
    for number, view in enumerate(views, 1):
        out += [""] + sample_lines(number, view, encoder, names, chars)
    return out
