"""What the loop says about skipped samples: one line per sample (rate-limited), and a stop when too many are bad.

Lines. The rank that counts a lane's skips into the run's total (the lane's data source, `topology.is_data_source`:
one rank per LLM lane, or per share where colocated encoders read their own) prints a line for each skip its
loader counted: the skips it passes in the stream it consumed, so the lines and the log's count agree, and no
sample is named twice (the lane's other ranks read the same samples). No collective is needed; lines carry the
rank when the run has several. At most `limit` lines per `window` seconds per rank; the rest are counted, and the
count is printed once the window is over (or at the end).

Stop. `skip_stop_message` says why a run whose skipped samples exceed `--max-skip-fraction` of the samples read
(trained plus skipped, counted as samples, packed or not), once `MIN_SAMPLES_READ` have been read, stops; the loop
saves and ends it with that line, exit 2 (run/stop.py). Every rank gets the same counts from the step, so every
rank stops at the same iteration.
"""

from __future__ import annotations

import time

from mimo.wording import counted

__all__ = ["MIN_SAMPLES_READ", "SkipReporter", "skip_stop_message"]

MIN_SAMPLES_READ = 100  # a few bad samples early on do not stop a run


class SkipReporter:
    """Prints the skip records of `source` (a DataSource's `take_skip_records()`) as they are counted."""

    def __init__(self, source, *, enabled: bool, rank: int | None = None, limit: int = 5, window: float = 60.0,
                 clock=time.monotonic, out=None):
        self._take = source.take_skip_records
        self.enabled, self.limit, self.window = enabled, limit, window
        self._prefix = f"[rank {rank}] " if rank is not None else ""
        self._clock = clock
        self._out = out or (lambda line: print(line, flush=True))
        self._window_start: float | None = None
        self._shown = self._hidden = 0

    def report(self) -> None:
        """Print the lines for the skips counted since the last call (call once per iteration)."""
        records = self._take()  # taken on every rank, so that none piles them up
        if not self.enabled:
            return
        now = self._clock()
        if self._window_start is not None and now - self._window_start >= self.window:
            self._summary()
            self._window_start = None
        for record in records:
            if self._window_start is None:
                self._window_start, self._shown = now, 0
            if self._shown < self.limit:
                self._shown += 1
                self._out(f"{self._prefix}skipped a sample {record.describe()}")
            else:
                self._hidden += 1

    def close(self) -> None:
        """Print the count of lines not shown, if any (at the end of the run)."""
        if self.enabled:
            self._summary()

    def _summary(self) -> None:
        if self._hidden:
            self._out(f"{self._prefix}skipped {counted(self._hidden, 'more sample')} in the last minute (not shown: "
                      f"at most {self.limit} lines a minute)")
            self._hidden = 0


def skip_stop_message(counts, max_fraction: float, data_path, seq_length: int | None = None) -> str | None:
    """Why the run stops when the skipped samples exceed `max_fraction` of the samples read (trained + skipped),
    with a hint for each reason that occurred; None while within it. `counts`: the run's DataCounts."""
    skipped = counts.skipped
    read = skipped + counts.samples
    if read < MIN_SAMPLES_READ or skipped <= max_fraction * read:
        return None
    at = f" {seq_length}" if seq_length else ""
    names = {"unreadable": "unreadable", "unsupported": "unsupported", "too_long": f"too long for seq_length{at}",
             "over_image_budget": "with images over a packed row's image tokens (--pack-image-tokens)"}
    reasons = ", ".join(f"{n} {names[r]}" for r, n in counts.by_reason().items() if n)
    hints = []
    if counts.too_long:
        hints.append("raise seq_length (--set seq_length=N)")
    if counts.over_image_budget:
        hints.append("make the images smaller (the provider's largest image size, e.g. --set max_pixels=N) or raise "
                     "--pack-image-tokens where `mimo plan` says it fits")
    if counts.unreadable or counts.unsupported:
        hints.append(f"repair --data {data_path}")
    hints.append("raise --max-skip-fraction")
    return (f"{skipped} of the {read} samples read were skipped ({skipped / read:.1%}: {reasons}), more than "
            f"--max-skip-fraction {max_fraction:g}: the lines above name them; {', or '.join(hints)}")
