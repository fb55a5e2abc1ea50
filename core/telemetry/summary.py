"""The lines a run ends with on its logging rank: what was trained, how fast, the last losses, where it all went."""

from __future__ import annotations

import math
import os

from mimo.wording import counted

from .truncation import REASONS


def _loss(value) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.6E}"


def summary_lines(session, first_iteration: int, seconds: float) -> list[str]:
    """`first_iteration`: the iteration the run started from (a resume's); `seconds`: wall time of this process's
    run, start-up included."""
    plan, logger = session.plan, session.logger
    trained = session.iteration - first_iteration
    speed = (f", {logger.trained_tokens / logger.trained_seconds:,.0f} tokens/s"
             if logger.trained_seconds > 0 else "")
    by_data = logger.records and logger.records[-1].get("tokens_counted") == "non-padding"
    if speed and by_data and logger.trained_row_tokens:  # --data: the samples' tokens, not the rows'
        padding = 1 - logger.trained_tokens / logger.trained_row_tokens
        speed += f" not counting padding ({padding:.0%} of the rows)"
    lines = [f"mimo run: finished {counted(trained, 'iteration')} ({first_iteration + 1} to {session.iteration} of "
             f"{plan.train_iters}) in {seconds:.1f} s{speed}"]
    losses = []
    if logger.records:
        last = logger.records[-1]
        losses.append(f"train {_loss(last['lm_loss'])} (iteration {last['iteration']})")
    if session.evaluations and session.evaluations.results:
        last = session.evaluations.results[-1]
        losses.append(f"validation {_loss(last.lm_loss)} (iteration {last.iteration})")
    if losses:
        lines.append("  last lm loss: " + ", ".join(losses))
    if getattr(session, "lora_summary", None):  # --lora-rank: what trained, on which base
        lines.append(session.lora_summary)
    record = logger.records[-1] if logger.records else {}
    if record.get("skipped_samples"):  # by reason, as the iteration line's `skipped samples` part
        by = [f"{record[f'skipped_{key}']} {what}" for key, what in REASONS if record.get(f"skipped_{key}")]
        why = " as unreadable" if by == [f"{record['skipped_samples']} unreadable"] else f" ({', '.join(by)})" if by \
            else ""
        lines.append(f"  data: {counted(record['skipped_samples'], 'sample')} skipped{why}")
    outputs = {"checkpoint": session.checkpointer.last_saved if session.checkpointer else None}
    lg = plan.config.logging
    outputs.update({"metrics": lg.metrics_file, "tensorboard": lg.tensorboard_dir, "profile": lg.profile_dir,
                    "log file": os.environ.get("MIMO_LOG_FILE")})
    lines += [f"  {name}: {path}" for name, path in outputs.items() if path]
    return lines
