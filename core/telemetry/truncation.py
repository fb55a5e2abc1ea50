"""What `--data` lost per logging interval: samples skipped (by reason) and tokens seq_length cut, for the log
line, the metrics file and TensorBoard, and a warning line when the cut takes more than `--truncation-warning`
of the answer tokens read (the first time, then at most once every `WARN_EVERY` iterations while it lasts)."""

from __future__ import annotations

__all__ = ["DataReport", "WARN_EVERY"]

WARN_EVERY = 100  # iterations between repeated truncation warnings


class DataReport:
    def __init__(self, *, share: float, seq_length: int | None, longest_needed=lambda: 0):
        """`share`: --truncation-warning; `longest_needed()`: the longest whole sample read (tokens)."""
        self.share, self.seq_length, self.longest_needed = share, seq_length, longest_needed
        self._since = 0  # the first iteration of the interval
        self._warned_at: int | None = None

    def fields(self, data, interval, iteration: int) -> dict:
        """The record's data fields: `data`, the counts over the run, and what `interval` (the counts since the
        last record, or since this process began) cut."""
        if data is None:
            return {}
        self._since, first = iteration + 1, self._since or 1
        return {"samples": data.samples, "skipped_samples": data.skipped, "skipped_unreadable": data.unreadable,
                "skipped_unsupported": data.unsupported, "skipped_too_long": data.too_long,
                "skipped_over_image_budget": data.over_image_budget,
                "truncated_tokens": interval.cut_tokens, "truncated_answer_tokens": interval.cut_answer_tokens,
                "answer_tokens": interval.answer_tokens, "interval_first_iteration": first}

    def warning(self, record: dict) -> str | None:
        """The warning line for this record's interval, when it is due."""
        answers, cut = record.get("answer_tokens", 0), record.get("truncated_answer_tokens", 0)
        if not answers or cut / answers <= self.share:
            return None
        iteration = record["iteration"]
        if self._warned_at is not None and iteration - self._warned_at < WARN_EVERY:
            return None
        self._warned_at = iteration
        needed = self.longest_needed() or 0
        fit = -(-needed // 64) * 64 if needed else None
        longest = f" (the longest sample read needs {needed} tokens)" if needed else ""
        raise_it = f"raise it (--set seq_length={fit})" if fit else "raise it (--set seq_length=N)"
        at = f" {self.seq_length}" if self.seq_length else ""
        span = record["interval_first_iteration"]
        iterations = f"iterations {span}-{iteration}" if span < iteration else f"iteration {iteration}"
        return (f"warning: seq_length{at} cut {cut / answers:.0%} of the answer tokens read in {iterations}{longest}: "
                f"{raise_it}, or see docs/data.md (Truncation)")


REASONS = (("unreadable", "unreadable"), ("unsupported", "unsupported"), ("too_long", "too long"),  # key, words
           ("over_image_budget", "images over the row's budget"))


def data_parts(r: dict) -> list[str]:
    """The log line's data parts: skipped samples by reason, and the interval's cut when there was one."""
    parts = []
    if r.get("skipped_samples"):
        by = [(r.get(f"skipped_{key}", 0), what) for key, what in REASONS]
        named = ", ".join(f"{n} {what}" for n, what in by if n) or str(r["skipped_samples"])
        parts.append(f"skipped samples {named}")
    if r.get("truncated_tokens"):
        share = (f", {r['truncated_answer_tokens'] / r['answer_tokens']:.0%} of answer tokens"
                 if r.get("answer_tokens") else "")
        parts.append(f"cut by seq_length: {r['truncated_tokens']} tokens{share}")
    return parts
