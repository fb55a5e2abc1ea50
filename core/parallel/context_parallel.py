"""Context parallelism of the LLM (`--llm-cp`): why a run's rows must split as they do, and the checks and
adaptations made on the model's own groups. What it needs of a run is checked before any process exists, with the
rest of the layout's rules (layout.py: `Layout.shard_multiple`, `Layout.check`).

megatron-core's MimoModel merges the encoders' embeddings into the text sequence, then splits the merged sequence
over the LLM's CP ranks with load balancing: the sequence is cut into 2 x CP chunks and CP rank r keeps chunks r and
2 x CP - 1 - r (`get_batch_on_this_cp_rank`), so every rank gets as much of the causal attention's work. Hence a
row must be a multiple of 2 x CP tokens (2 x CP x TP under sequence parallelism, which then scatters each CP rank's
part over TP). Packed rows (THD) are split per segment by transformer-engine (`thd_get_partitioned_indices` on
`cu_seqlens_q_padded`, which its attention and megatron-core's MambaContextParallel read too): mimo's packing pads
each packed sample to a multiple of the same `Layout.shard_multiple` (`DataContext.segment_multiple`,
data/task_encoder.py), and each sequence is its padded place (its padding attended after it, trained on by nothing),
so no padding between sequences is left for transformer-engine to handle. On 2 H200s (nemotron-moe-vlm-tiny, te, bf16, packed `--data`) CP 2
gave CP 1's losses within 1e-4 (docs/parallelism.md). The split itself is transformer-engine's: without it (the CPU,
the local backend) packed rows with CP are refused in one line.
"""

from __future__ import annotations

from mimo.errors import UsageError


def check_row(model, width: int) -> None:
    """A micro-batch's rows must split evenly over CP: one line here instead of megatron-core's assertion. `model`:
    the MimoModel, whose partition adapter holds its CP (and SP) groups on LLM ranks."""
    cfg = getattr(getattr(model, "partition_adapter", None), "cfg", None)
    if cfg is None or not cfg.use_cp:
        return
    multiple = 2 * cfg.cp_group.size() * (cfg.tp_group.size() if cfg.seq_parallel else 1)
    if width % multiple:
        raise UsageError(f"a micro-batch row of {width} tokens does not split over context parallelism: rows must "
                         f"be a multiple of {multiple} (2 x --llm-cp, x TP under --sequence-parallel); pad the data "
                         f"to such a length")


def local_rows(model, packing_kwargs: dict | None) -> dict | None:
    """A packed batch's `packing_kwargs` with `tokens_per_sample` (the row length the task encoder gives) as the
    tokens of a row this rank's MoE layers hold, which megatron-core divides their tokens by to restore the rows
    (its sequence-level auxiliary loss is then each row's): a CP rank holds 1/CP of every row (transformer-engine
    splits each of a row's segments); sequence parallelism cuts the flattened rows over TP, which no row length
    describes, so there it is left out (the loss then spans the micro-batch's rows). MoE layers of
    `mimo.plugins.kit.packed_seq_aux_loss` (Nemotron's) ignore it: they balance each packed sample, on any
    layout."""
    if not packing_kwargs or not packing_kwargs.get("tokens_per_sample"):
        return packing_kwargs
    cfg = getattr(getattr(model, "partition_adapter", None), "cfg", None)
    if cfg is None:
        return packing_kwargs
    row = int(packing_kwargs["tokens_per_sample"])
    if cfg.seq_parallel and cfg.tp_group is not None and cfg.tp_group.size() > 1:
        row = None
    elif cfg.use_cp:
        row //= cfg.cp_group.size()
    return {**packing_kwargs, "tokens_per_sample": row}
