"""The lines a run ends with on its logging rank: what was trained, how fast, the last losses, where it all went."""

from __future__ import annotations

import math
import os


def _loss(value) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.6E}"


def summary_lines(session, first_iteration: int, seconds: float) -> list[str]:
    """`first_iteration`: the iteration the run started from (a resume's); `seconds`: wall time of this process's
    run, start-up included."""
    plan, logger = session.plan, session.logger
    trained = session.iteration - first_iteration
    speed = (f", {logger.trained_tokens / logger.trained_seconds:,.0f} tokens/s"
             if logger.trained_seconds > 0 else "")
    lines = [f"mimo run: finished {trained} iterations ({first_iteration + 1} to {session.iteration} of "
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
    skipped = logger.records[-1].get("skipped_samples", 0) if logger.records else 0
    if skipped:
        lines.append(f"  data: {skipped} sample{'s' if skipped != 1 else ''} skipped as unreadable")
    outputs = {"checkpoint": session.checkpointer.last_saved if session.checkpointer else None}
    lg = plan.config.logging
    outputs.update({"metrics": lg.metrics_file, "tensorboard": lg.tensorboard_dir, "profile": lg.profile_dir,
                    "log file": os.environ.get("MIMO_LOG_FILE")})
    lines += [f"  {name}: {path}" for name, path in outputs.items() if path]
    return lines
