"""`mimo data inspect`: what a dataset holds, from a bounded read of its first samples (`SampleReader`, a blend's
members by weight), and with a provider's task encoder what training would make of it.

Without an encoder: the splits and their sizes, the formats read, images per sample, image sizes, and the samples
that cannot be read. With one (`SampleView`: the encoder's own `encode_sample`): each image's patches and tokens,
text, image, total and trained tokens per sample, what `seq_length` cuts or skips, and how full the packed rows
would be, packed by the encoder's own packer (`pack_rows`). Console lines fit 80 columns; `as_dict` is the JSON.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .sample_reader import Member, SampleReader, split_sizes
from .sample_view import SampleView, Viewer
from .skips import REASONS, TOO_LONG, SkipRecord

__all__ = ["ImageCount", "Inspection", "counted", "histogram", "inspect_dataset", "pack_rows", "pack_sizes",
           "percentiles"]

WIDTH = 80
# the percentile table's rows: JSON key -> console label
LABELS = {"image_width": "image width (px)", "image_height": "image height (px)", "patches_per_image":
          "patches / image", "tokens_per_image": "tokens / image", "text_tokens": "text tokens / sample",
          "image_tokens": "image tokens / sample", "total_tokens": "total tokens / sample", "trained_tokens":
          "trained tokens / sample"}
SHOWN_SKIPS = 5  # skipped samples named on the console (the JSON has up to SKIPS_KEPT)
SKIPS_KEPT = 100
BAR = 36  # the histogram's longest bar


def percentiles(values) -> dict | None:
    """p50, p90, p99 (nearest rank), max and mean of `values`, or None when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = lambda p: ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]  # noqa: E731
    return {"p50": rank(50), "p90": rank(90), "p99": rank(99), "max": ordered[-1],
            "mean": round(sum(ordered) / len(ordered), 1)}


def histogram(values, bins: int = 8, edge: int | None = None) -> list[tuple[int, int, int]]:
    """(low, high, count) of `values` (integers) in about `bins` bins of equal width, both ends inclusive; a bin
    ends at `edge` (seq_length) when it lies among the values, so no bin holds values on both sides of it."""
    if not values:
        return []
    low, high = min(values), max(values)
    width = max(1, math.ceil((high - low + 1) / bins))
    if edge is not None and low <= edge < high:
        low -= (width - (edge + 1 - low) % width) % width
    counts = Counter((v - low) // width for v in values)
    return [(low + i * width, low + (i + 1) * width - 1, counts.get(i, 0))
            for i in range((high - low) // width + 1)]


def pack_sizes(encoder, encoded: list, buffer_size: int) -> list[tuple[int, int]]:
    """(tokens, image tokens) of each row training would make of `encoded` (the encoder's samples, in read order):
    the encoder's own packer (`select_samples_to_pack`, energon's call) over buffers of `buffer_size` samples; one
    row per sample when the encoder does not pack."""
    rows = []
    for start in range(0, len(encoded), max(1, buffer_size)):
        for group in encoder.select_samples_to_pack(encoded[start:start + buffer_size]):
            rows.append((sum(len(sample.tokens) for sample in group),
                         sum(image.num_tokens for sample in group for image in sample.images)))
    return rows


def pack_rows(encoder, encoded: list, buffer_size: int) -> list[int]:
    """The tokens of each row training would make of `encoded` (`pack_sizes`)."""
    return [tokens for tokens, _ in pack_sizes(encoder, encoded, buffer_size)]


@dataclass(frozen=True)
class ImageCount:
    """An encoded image without its pixels: what the packer reads of it (its image budget counts placeholders)."""

    num_tokens: int


def counted(sample):
    """`sample` (an EncodedSample) with its images' pixels dropped and their placeholders kept, so that a bounded
    read stays small and the packer still holds rows to their image budget."""
    return dataclasses.replace(sample, images=[ImageCount(image.num_tokens) for image in sample.images])


@dataclass
class Inspection:
    path: str
    split: str
    splits: dict[str, int]
    members: list[Member]
    limit: int | None
    read: int = 0
    formats: Counter = field(default_factory=Counter)
    images_per_sample: Counter = field(default_factory=Counter)
    skipped: list[SkipRecord] = field(default_factory=list)
    skip_counts: Counter = field(default_factory=Counter)
    columns: dict[str, list[int]] = field(default_factory=dict)  # LABELS' values, read so far
    provider: str | None = None
    seq_length: int | None = None
    packed: bool | None = None
    buffer_size: int | None = None
    cut_samples: int = 0
    cut_tokens: int = 0
    cut_answer_tokens: int = 0
    answer_tokens: int = 0
    rows: list[int] = field(default_factory=list)  # tokens in each row training would make
    encoded: int = 0  # samples the encoder encoded (the rows hold them)

    def add(self, view: SampleView) -> None:
        self.read += 1
        if view.kind is not None:
            self.formats[view.kind] += 1
            self.images_per_sample[len(view.image_sizes)] += 1
        if view.skipped is not None:
            self.skip_counts[view.skipped.reason] += 1
            if len(self.skipped) < SKIPS_KEPT:
                self.skipped.append(view.skipped)
        col = lambda name: self.columns.setdefault(name, [])  # noqa: E731
        col("image_width").extend(w for w, _ in view.image_sizes)
        col("image_height").extend(h for _, h in view.image_sizes)
        if self.provider is None:
            return
        col("patches_per_image").extend(p for p in view.image_patches if p is not None)
        col("tokens_per_image").extend(view.image_tokens)
        if view.needed_tokens is not None:  # encoded, or skipped as too long (its whole length is known)
            col("text_tokens").append(view.text_tokens)
            col("image_tokens").append(sum(view.image_tokens))
            col("total_tokens").append(view.needed_tokens)
        if view.encoded is not None:
            e = view.encoded
            col("trained_tokens").append(e.answer_tokens)
            self.cut_samples += e.cut_tokens > 0
            self.cut_tokens += e.cut_tokens
            self.cut_answer_tokens += e.cut_answer_tokens
            self.answer_tokens += e.answer_tokens

    # -- the console --------------------------------------------------------------------------------------------

    def lines(self) -> list[str]:
        out = [_fit(f"dataset {self.path}")]
        out += _wrap("splits: " + ", ".join(f"{name} {count:,}" for name, count in self.splits.items()))
        if len(self.members) > 1:
            out += self._member_lines()
        else:
            out.append(_fit(f"declared samples: {_declared(self.members[0].sample_type)}"))
        total = sum(m.samples for m in self.members)
        bound = "all" if self.read >= total else f"--limit {self.limit}"
        mix = ", the members mixed by weight" if len(self.members) > 1 else ""
        out.append(_fit(f"read: {self.read:,} of the {total:,} {self.split} samples ({bound}{mix})"))
        out += _wrap("formats: " + (", ".join(f"{k} {n}" for k, n in self.formats.most_common()) or "none read"))
        out += _wrap("images per sample: " + ", ".join(f"{k}: {n}" for k, n in sorted(self.images_per_sample.items())))
        out += self._skip_lines()
        if self.provider is not None:
            pack = f"packed from buffers of {self.buffer_size}" if self.packed else "not packed"
            out += [""] + _wrap(f"provider {self.provider}: seq_length {self.seq_length}, {pack}")
        table = [(LABELS[key], stats) for key in LABELS if (stats := percentiles(self.columns.get(key, ())))]
        if table:
            out += ["", f"{'':<24}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}{'mean':>11}"]
            out += [f"{name:<24}" + "".join(f"{s[k]:>9,}" for k in ("p50", "p90", "p99", "max"))
                    + f"{s['mean']:>11,.1f}" for name, s in table]
        if self.provider is not None:
            out += self._length_lines()
        else:
            out += ["", "(tokens, patches and packing: give --provider NAME, as for mimo run)"]
        return out

    def _member_lines(self) -> list[str]:
        base = Path(self.path).resolve().parent
        out = [f"a blend of {len(self.members)} datasets:", f"  {'weight':>6}  {'samples':>8}  {'declared':<24}dataset"]
        for m in self.members:
            where = Path(m.path)
            where = str(where.relative_to(base)) if where.is_relative_to(base) else str(where)
            out.append(_fit(f"  {m.weight:>6.3g}  {m.samples:>8,}  {_declared(m.sample_type):<24}{where}"))
        return out

    def _skip_lines(self) -> list[str]:
        count = sum(self.skip_counts.values())
        if not count:
            return ["skipped: none"]
        reasons = ", ".join(f"{n} {REASONS.get(r, r)}" for r, n in self.skip_counts.most_common())
        out = _wrap(f"skipped: {count} of {self.read} ({reasons})")
        for r in self.skipped[:SHOWN_SKIPS]:
            where = f"{Path(r.dataset).name}/" if r.dataset and len(self.members) > 1 else ""
            out += _wrap(f"  {where}{r.shard or '?'} key {r.key or '?'}: {r.error or REASONS.get(r.reason)}",
                         indent=6)
        if count > SHOWN_SKIPS:
            out.append(f"  ... {count - SHOWN_SKIPS} more (--json lists up to {SKIPS_KEPT})")
        return out

    def _length_lines(self) -> list[str]:
        out = []
        bins = histogram(self.columns.get("total_tokens", []), edge=self.seq_length)
        if bins:
            most = max(n for _, _, n in bins) or 1
            digits = len(str(bins[-1][1]))
            out += ["", "total tokens per sample:"]
            for low, high, n in bins:
                over = "  > seq_length" if low > self.seq_length else ""
                out.append(f"  {low:>{digits}}-{high:<{digits}} {'#' * math.ceil(BAR * n / most):<{BAR}} {n}{over}")
        out.append("")
        share = self.cut_answer_tokens / self.answer_tokens if self.answer_tokens else 0.0
        too_long = self.skip_counts.get(TOO_LONG, 0)
        out += _wrap(f"cut by seq_length {self.seq_length}: {self.cut_samples} samples lose {self.cut_tokens:,} "
                     f"tokens ({share:.0%} of the answer tokens)"
                     + (f"; {too_long} more keep nothing and are skipped" if too_long else ""))
        if self.rows:
            fills = [used / self.seq_length for used in self.rows]
            mean = sum(self.rows) / (len(self.rows) * self.seq_length)
            how = (f" packed into {len(self.rows)} rows of {self.seq_length} tokens" if self.packed else
                   f", one a row of {self.seq_length} tokens (not packed)")
            out += _wrap(f"rows: {self.encoded} samples{how}: {mean:.0%} full (p50 {percentiles(fills)['p50']:.0%}, "
                         f"min {min(fills):.0%})")
        return out

    # -- JSON ---------------------------------------------------------------------------------------------------

    def as_dict(self) -> dict:
        out = {"dataset": self.path, "split": self.split, "splits": self.splits,
               "members": [dataclasses.asdict(m) for m in self.members], "limit": self.limit, "read": self.read,
               "formats": dict(self.formats), "images_per_sample": {str(k): n for k, n in
                                                                    sorted(self.images_per_sample.items())},
               "skipped": dict(self.skip_counts), "skipped_samples": [dataclasses.asdict(r) for r in self.skipped],
               "provider": self.provider,
               "stats": {key: percentiles(self.columns[key]) for key in LABELS if key in self.columns}}
        if self.provider is not None:
            fills = [used / self.seq_length for used in self.rows]
            out.update(seq_length=self.seq_length, histogram=[list(b) for b in histogram(
                self.columns.get("total_tokens", []), edge=self.seq_length)],
                truncation={"cut_samples": self.cut_samples, "cut_tokens": self.cut_tokens,
                            "cut_answer_tokens": self.cut_answer_tokens, "answer_tokens": self.answer_tokens},
                packing={"packed": self.packed, "buffer_size": self.buffer_size, "samples": self.encoded,
                         "rows": len(self.rows),
                         "fill": round(sum(self.rows) / (len(self.rows) * self.seq_length), 4) if self.rows else None,
                         "row_fill": percentiles([round(f, 4) for f in fills])})
        return out


def _declared(sample_type: str) -> str:
    return {"CrudeSample": "CrudeWebdataset (chat)", "ChatMLRecord": "ChatMLWebdataset (Bridge)"}.get(sample_type,
                                                                                                    sample_type)


def _fit(line: str) -> str:
    return line if len(line) <= WIDTH else line[:WIDTH - 3] + "..."


def _wrap(line: str, indent: int = 2) -> list[str]:
    return textwrap.wrap(line, WIDTH, subsequent_indent=" " * indent, break_on_hyphens=False,
                         drop_whitespace=True) or [""]


def inspect_dataset(path, split: str = "train", limit: int | None = 1000, encoder=None, provider: str | None = None,
                    buffer_size: int = 64, command: str = "dataset") -> Inspection:
    """Read the first `limit` samples (all: None) of `path`'s `split` and describe them; with `encoder` (the task
    encoder of `provider`), as that encoder encodes and packs them."""
    reader = SampleReader(path, split, encoder, f"provider '{provider}'" if provider else "mimo", command)
    viewer = Viewer(encoder)
    result = Inspection(str(path), split, split_sizes(path), reader.members, limit, provider=provider)
    if encoder is not None:
        result.seq_length, result.packed = encoder.seq_length, bool(getattr(encoder, "pack_sequences", False))
        result.buffer_size = buffer_size
    encoded = []
    for read in reader:
        if limit is not None and result.read >= limit:
            break
        view = viewer.view(read)
        result.add(view)
        if view.encoded is not None:  # its pixels are not needed to pack (nor kept: a bounded read stays small)
            encoded.append(counted(view.encoded))
    if encoder is not None:
        result.rows, result.encoded = pack_rows(encoder, encoded, buffer_size), len(encoded)
    return result
