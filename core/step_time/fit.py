"""Fitting the calibration's rates to measured runs (scripts/fit_step_time.py drives it from the records).

A colocated run's iteration is linear in four unknown rates: seconds per encoder FLOP and per LLM FLOP (the
modules' efficiencies), and seconds per byte of the experts' all-to-all and of the other collectives; the rest
(the optimizer, extra encoder passes) comes from rates fitted before them. Least squares on
the relative error, one row per run, gives the four; with four runs they are determined exactly.
The heterogeneous layout's per-micro-batch overheads come from the stage-overlap probe's per-stage busy times.
"""

from __future__ import annotations

import dataclasses

from .calibration import Calibration
from .model import StepInputs, estimate

UNKNOWNS = ("encoder", "language", "all_to_all", "collective")


def row(inputs: StepInputs, known: Calibration) -> tuple[list[float], float]:
    """(coefficients of UNKNOWNS, seconds of the known terms) of a colocated run's iteration."""
    # the unknown rates at 1: the quantities they multiply do not depend on them
    est = estimate(inputs, dataclasses.replace(known, efficiency={"encoder": 1.0, "language": 1.0},
                                               all_to_all_bytes_per_s=1.0, collective_bytes_per_s=1.0))
    if len(est.stages) != 1:
        raise ValueError("only colocated runs are fitted: a split's time is not linear in the rates")
    stage = est.stages[0]
    w = stage.work
    coefficients = [w.encoder_flops, w.language_flops, w.ep_bytes, w.tp_bytes + w.cp_bytes + stage.reduce_bytes]
    known_s = est.optimizer_s + w.extra_encoder_passes * known.encoder_pass_overhead_s
    return coefficients, known_s


def least_squares(rows: list[tuple[list[float], float]], measured_s: list[float]) -> list[float]:
    """The rates that minimise the summed squared relative error of the predicted iterations."""
    a = [[c / t for c in coefficients] for (coefficients, _), t in zip(rows, measured_s)]
    b = [(t - known) / t for (_, known), t in zip(rows, measured_s)]
    n = len(UNKNOWNS)
    normal = [[sum(r[i] * r[j] for r in a) for j in range(n)] + [sum(r[i] * y for r, y in zip(a, b))]
              for i in range(n)]
    return _solve(normal)


def _solve(augmented: list[list[float]]) -> list[float]:
    """Gaussian elimination with partial pivoting on an n x (n + 1) augmented matrix."""
    m = [list(r) for r in augmented]
    n = len(m)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            raise ValueError("the runs do not determine every rate (a singular system)")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            m[r] = [x - factor * y for x, y in zip(m[r], m[col])]
    out = [0.0] * n
    for r in reversed(range(n)):
        out[r] = (m[r][n] - sum(m[r][c] * out[c] for c in range(r + 1, n))) / m[r][r]
    return out


def with_rates(known: Calibration, rates: list[float]) -> Calibration:
    """`known` with the fitted rates (seconds per FLOP, per byte) in its units."""
    encoder, language, all_to_all, collective = rates
    return dataclasses.replace(
        known, efficiency={"encoder": 1 / (encoder * known.peak_flops), "language": 1 / (language * known.peak_flops)},
        all_to_all_bytes_per_s=1 / all_to_all, collective_bytes_per_s=1 / collective)


def probe_overheads(encoder_share: float, colocated_busy_s: float, colocated_samples_per_gpu: int,
                    encoder_busy_s: float, language_busy_s: float, split_iteration_s: float,
                    split_optimizer_s: float, micro_batches: int) -> dict[str, float]:
    """The split's per-micro-batch costs from a probe of one model in both layouts.

    The colocated run's forward and backward (`colocated_busy_s` per `colocated_samples_per_gpu`, the encoders
    once per step) is shared by FLOPs (`encoder_share`); each stage of the split runs its module's share for all
    `micro_batches` samples, and what it was busy beyond that is its overhead: per encoder pass beyond the first,
    per LLM micro-batch. What the split's iteration took beyond the 1F1B pipeline of those busy times (and its
    optimizer step) is the bridge's, per micro-batch."""
    per_sample = colocated_busy_s / colocated_samples_per_gpu
    encoder_s = micro_batches * per_sample * encoder_share
    language_s = micro_batches * per_sample * (1 - encoder_share)
    per_stage = [encoder_busy_s / micro_batches, language_busy_s / micro_batches]
    pipeline = sum(per_stage) + (micro_batches - 1) * max(per_stage)
    return {"encoder_pass_overhead_s": (encoder_busy_s - encoder_s) / (micro_batches - 1),
            "split_stage_overhead_s": (language_busy_s - language_s) / micro_batches,
            "bridge_s": (split_iteration_s - split_optimizer_s - pipeline) / micro_batches}
