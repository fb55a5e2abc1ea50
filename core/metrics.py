"""The log line and the metrics file: one record per logged iteration, written by one rank."""

from __future__ import annotations

import json
import time
from pathlib import Path


class MetricsLogger:
    def __init__(self, log_interval: int, total_iters: int, metrics_file: Path | None, enabled: bool,
                 tokens_per_iteration: int):
        self.log_interval, self.total_iters = log_interval, total_iters
        self.enabled, self.tokens_per_iteration = enabled, tokens_per_iteration
        self.metrics_file = Path(metrics_file) if metrics_file and enabled else None
        if self.metrics_file:
            self.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        self.records: list[dict] = []
        self._reset()

    def _reset(self):
        self._loss_sum = self._tokens = self._iters = self._skipped = 0
        self._start = time.perf_counter()

    def update(self, iteration: int, result, consumed_samples: int) -> dict | None:
        """Account one iteration; at the end of a log interval return (and print/write) its record."""
        self._loss_sum += result.lm_loss * result.num_tokens
        self._tokens += result.num_tokens
        self._iters += 1
        self._skipped += int(result.skipped)
        if iteration % self.log_interval and iteration != self.total_iters:
            return None
        elapsed_ms = (time.perf_counter() - self._start) * 1000 / self._iters
        record = {
            "iteration": iteration,
            "lm_loss": self._loss_sum / max(self._tokens, 1),
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "consumed_samples": consumed_samples,
            "elapsed_ms": elapsed_ms,
            "tokens_per_sec": self.tokens_per_iteration / (elapsed_ms / 1000),
            "skipped_iterations": self._skipped,
            "skipped_samples": result.skipped_samples,
            **{f"grad_norm_{name}": norm for name, norm in result.module_grad_norms.items()},
        }
        self._reset()
        self.records.append(record)
        if self.enabled:
            print(format_line(record, self.total_iters), flush=True)
            if self.metrics_file:
                with self.metrics_file.open("a") as f:
                    f.write(json.dumps(record) + "\n")
        return record


def format_line(r: dict, total_iters: int) -> str:
    grad_norm = "n/a" if r["grad_norm"] is None else f"{r['grad_norm']:.3f}"
    return (
        f"iteration {r['iteration']:>6}/{total_iters} | consumed samples {r['consumed_samples']:>8} | "
        f"elapsed ms/iter {r['elapsed_ms']:8.1f} | tokens/s {r['tokens_per_sec']:9.0f} | lr {r['lr']:.3E} | "
        f"lm loss {r['lm_loss']:.6E} | grad norm {grad_norm} | skipped {r['skipped_iterations']}"
        + (f" | unreadable samples skipped {r['skipped_samples']}" if r["skipped_samples"] else "")
    )
