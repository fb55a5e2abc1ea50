"""A logging interval's throughput: tokens, samples and images per second, the padding share, TFLOP/s and MFU.

With data that counts what it trains (`--data`: `mimo.data.DataCounts`, from the interval's change in the counts)
the tokens are the samples' own (a row's padding left out), the samples are samples (not packs), and the FLOPs
are those of the samples run (the provider's `sample_flops` from each one's length and images; without it
`model_flops` per row of seq_length). Synthetic data, whose rows are whole samples with no padding, keeps the
figures of the batch's shape: global batch x seq_length tokens and `model_flops` per row. `tokens_counted` and
`flops_counted` in the record say which.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Interval", "throughput"]


@dataclass
class Interval:
    """What one logging interval ran."""

    seconds: float  # wall time of its iterations, evaluations left out
    iterations: int
    loss_tokens: int  # tokens that counted in the loss, every lane
    data: object | None = None  # the DataCounts it consumed (None: the data counts nothing)


def throughput(interval: Interval, *, world_size: int, global_batch_size: int, seq_length: int,
               flops_per_row: float | None, peak: float | None) -> tuple[dict, int, int]:
    """(the record's throughput fields, the tokens the interval trained, its rows' tokens with their padding).
    `flops_per_row`: forward FLOPs of a row by `model_flops`; `peak`: the GPU's dense bf16 TFLOP/s (MFU), None
    where unknown."""
    data, seconds = interval.data, interval.seconds
    rows = global_batch_size * interval.iterations
    per_gpu = seconds * world_size
    if data is not None:
        rows = data.rows
    row_tokens = rows * seq_length
    tokens = data.tokens if data is not None else row_tokens
    fields = {"tokens_per_sec": tokens / seconds, "tokens_per_sec_per_gpu": tokens / per_gpu,
              "loss_tokens_per_sec_per_gpu": interval.loss_tokens / per_gpu,
              "tokens_counted": "non-padding" if data is not None else "rows"}
    if data is not None:
        fields.update(row_tokens_per_sec_per_gpu=row_tokens / per_gpu, samples_per_sec=data.samples / seconds,
                      images_per_sec=data.images / seconds)
        if rows:
            fields.update(padding_share=1 - data.tokens / row_tokens, samples_per_row=data.samples / rows)
    flops, counted = 0.0, "rows"
    if data is not None and data.flops:
        flops, counted = float(data.flops), "samples"
    elif flops_per_row:
        flops = flops_per_row * rows
    if flops:
        fields["tflops_per_gpu"] = 3 * flops / per_gpu / 1e12  # training: forward and twice that in backward
        fields["flops_counted"] = counted
        if peak:
            fields["mfu"] = fields["tflops_per_gpu"] / peak
    return fields, tokens, row_tokens
