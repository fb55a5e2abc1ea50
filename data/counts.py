"""What the data counted at consumption, per lane and summed over a run: samples trained, samples skipped (by
reason), what seq_length cut, and the work the trained samples are (their tokens, images, rows and FLOPs). The
loop all-reduces these as one fixed-order vector with the step's totals (`core/run/step.py`), so every rank sees
the run's figures at the same iteration. A checkpoint's counts of a mimo that counted fewer fields load with the
new ones at 0."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .skips import OVER_IMAGE_BUDGET, TOO_LONG, UNREADABLE, UNSUPPORTED

__all__ = ["DataCounts"]


@dataclass
class DataCounts:
    samples: int = 0  # samples trained (packed samples each count), not rows
    unreadable: int = 0
    unsupported: int = 0
    too_long: int = 0
    cut_tokens: int = 0  # tokens of trained samples that seq_length cut off
    cut_answer_tokens: int = 0  # of those, tokens the template trains (answers)
    answer_tokens: int = 0  # trained tokens of the trained samples before the cut
    data_error: int = 0  # lanes whose data failed (the loop stops, see lane_loader.py)
    tokens: int = 0  # the trained samples' tokens (their lengths after the cut): what is not padding
    images: int = 0  # the trained samples' images
    rows: int = 0  # rows (packs, or single samples) trained: each takes a row of seq_length tokens
    flops: int = 0  # forward FLOPs of the trained samples, every module (0: the data source counts none)
    over_image_budget: int = 0  # skipped: packed, its images over a row's image budget (last: older states lack it)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def vector(self) -> list[float]:
        return [float(getattr(self, name)) for name in self.names()]

    @classmethod
    def from_vector(cls, values) -> DataCounts:
        return cls(**{name: int(round(v)) for name, v in zip(cls.names(), values)})

    @property
    def skipped(self) -> int:
        return self.unreadable + self.unsupported + self.too_long + self.over_image_budget

    def by_reason(self) -> dict[str, int]:
        return {UNREADABLE: self.unreadable, UNSUPPORTED: self.unsupported, TOO_LONG: self.too_long,
                OVER_IMAGE_BUDGET: self.over_image_budget}

    def __add__(self, other: DataCounts) -> DataCounts:
        return DataCounts(*(getattr(self, n) + getattr(other, n) for n in self.names()))

    def __sub__(self, other: DataCounts) -> DataCounts:
        return DataCounts(*(getattr(self, n) - getattr(other, n) for n in self.names()))
