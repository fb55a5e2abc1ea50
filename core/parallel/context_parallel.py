"""What context parallelism of the LLM (`--llm-cp`) needs of a run, checked before any process exists.

megatron-core's MimoModel merges the encoders' embeddings into the text sequence, then splits the merged sequence
over the LLM's CP ranks with load balancing: the sequence is cut into 2 x CP chunks and CP rank r keeps chunks r and
2 x CP - 1 - r (`get_batch_on_this_cp_rank`), so every rank gets as much of the causal attention's work. Hence a
row must be a multiple of 2 x CP tokens (2 x CP x TP under sequence parallelism, which then scatters each CP rank's
part over TP). Packed rows (THD) are split per segment by transformer-engine (`thd_get_partitioned_indices` on
`cu_seqlens_q_padded`, which its attention and megatron-core's MambaContextParallel read too): mimo's packing pads
each packed sample to a multiple of the same `shard_multiple` (`DataContext.segment_multiple`, data/task_encoder.py),
and each sequence is its padded place (its padding attended after it, trained on by nothing), so no padding between
sequences is left for transformer-engine to handle. On 2 H200s (nemotron-moe-vlm-tiny, te, bf16, packed `--data`) CP 2
gave CP 1's losses within 1e-4 (docs/parallelism.md). The split itself is transformer-engine's: without it (the CPU,
the local backend) packed rows with CP are refused in one line.
"""

from __future__ import annotations

import importlib.util

from mimo.errors import UsageError
from mimo.plugins import ModuleParallelism


def shard_multiple(llm: ModuleParallelism, sequence_parallel: bool) -> int:
    """The multiple of tokens a row of the LLM's input (a packed segment's padded length, with packing) must
    be for its CP (and SP) split; 1 without CP."""
    if llm.cp == 1:
        return 1
    return 2 * llm.cp * (llm.tp if sequence_parallel and llm.tp > 1 else 1)


def splits_packed_rows(device: str) -> bool:
    """Whether a run on `device` can split packed (THD) rows over CP: transformer-engine's
    `thd_get_partitioned_indices` does, on GPUs. A plan for GPUs made on a host without one counts as able: the
    workers make the plan again on their GPU hosts, where this looks for transformer-engine."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return False
    return not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine_torch") is not None


def check(llm: ModuleParallelism, *, seq_length: int | None, sequence_parallel: bool, pack_sequences: bool,
          cuda_graphs: bool = False, splits_packed: bool = True) -> None:
    """UsageError, one line naming the option to change, when the run cannot split its LLM sequence over CP."""
    if llm.cp == 1:
        return
    if cuda_graphs:
        # measured on 2 H200s (docs/parallelism.md): the slice trained alike with and without graphs, as fast, and
        # the run with graphs did not exit after its last iteration
        raise UsageError(f"--llm-cp {llm.cp} with --cuda-graphs is not supported yet (a CP run with graphs did not "
                         f"end after its last iteration, and was no faster); leave --cuda-graphs off")
    if pack_sequences and not splits_packed:
        raise UsageError(f"--llm-cp {llm.cp} with --pack-sequences needs transformer-engine on GPUs (its split of "
                         f"packed rows; the CPU's backends have none): run on GPUs with mimo[te] installed, or "
                         f"without --pack-sequences")
    multiple = shard_multiple(llm, sequence_parallel)
    if seq_length is not None and seq_length % multiple:
        what = f"2 x CP x TP = 2 x {llm.cp} x {llm.tp}" if multiple != 2 * llm.cp else f"2 x CP = 2 x {llm.cp}"
        fits = -(-seq_length // multiple) * multiple
        raise UsageError(f"--llm-cp {llm.cp}: the sequence length {seq_length} must be a multiple of {what} = "
                         f"{multiple} (the load-balanced split); use --set seq_length={fits}")


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
    describes, so there it is left out (the loss then spans the micro-batch's rows)."""
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
