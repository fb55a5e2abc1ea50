"""Colocated encoders at a TP of their own: their embeddings change hands between the encoders' data-parallel
layout and the LLM's on the same ranks, whatever the rows each rank holds.

megatron-core 0.19.2's MimoModel builds a `ColocatedBridgeCommunicator` per encoder when the grids share ranks:
its gather groups pair the encoder ranks that feed one LLM lane (fan-in, encoder DP > LLM DP) or the LLM ranks one
encoder replica feeds (fan-out, encoder DP < LLM DP). Its exchange, though, assumes the same number of rows on
every rank (`all_gather_into_tensor`, equal narrows), which a micro-batch without images, or images of other sizes,
breaks. This adapter keeps its groups and its direction and moves the rows each rank really has: the caller
passes every sibling's row count, read from the placeholders of the micro-batch rows on the host
(forward/shared_rank_batches.py), so no sizes travel.

- fan-in: forward gathers the siblings' rows in slot order; backward keeps this rank's slot of the gradient
  (the LLM's TP ranks hold the same full gradient of their input).
- fan-out: forward keeps this rank's lane of the encoder replica's output; backward gathers every lane's gradient,
  since every rank of the replica needs the whole of it.

One module with one job, replaceable when a megatron-core release moves uneven rows itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def exchange(comm, tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`tensor` (this rank's rows on the encoder side) on the LLM side, over megatron-core's colocated bridge
    `comm`; `rows[k]`: the rows of the k-th rank of this rank's gather group (its slots, in order)."""
    if comm.is_fan_in() or comm.is_fan_out():
        return _Exchange.apply(tensor, comm, list(rows), _slot(comm))
    return tensor


def _slot(comm) -> int:
    """This rank's place in its gather group: its DP index on the side that has more of them, modulo the scale
    (megatron-core's `get_slice_info`); the group's ranks are in that order."""
    rank = dist.get_rank()
    dp = comm.rank_to_src_pos[rank][0] if comm.is_fan_in() else comm.rank_to_dest_pos[rank][0]
    slot = dp % comm.scale
    if dist.get_rank(comm.gather_pg) != slot:
        raise RuntimeError(f"the colocated bridge's gather group puts rank {rank} at {dist.get_rank(comm.gather_pg)}, "
                           f"not at its slot {slot}")
    return slot


def gather_rows(tensor: torch.Tensor, rows: list[int], group) -> torch.Tensor:
    """Every group rank's rows (`rows[k]` of rank k), concatenated in group order."""
    longest = max(rows)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    pieces = [torch.empty_like(padded) for _ in rows]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([piece[:n] for piece, n in zip(pieces, rows)])


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, comm, rows, slot):
        ctx.comm, ctx.rows, ctx.slot = comm, rows, slot
        if comm.is_fan_in():
            if tensor.shape[0] != rows[slot]:
                raise ValueError(f"the encoder's {tensor.shape[0]} rows do not match the {rows[slot]} placeholders of "
                                 f"this rank's samples")
            return gather_rows(tensor, rows, comm.gather_pg)
        if tensor.shape[0] != sum(rows):
            raise ValueError(f"the encoder's {tensor.shape[0]} rows do not match the {sum(rows)} placeholders of its "
                             f"lanes")
        start = sum(rows[:slot])
        return tensor[start: start + rows[slot]].contiguous()

    @staticmethod
    def backward(ctx, grad):
        comm, rows, slot = ctx.comm, ctx.rows, ctx.slot
        if comm.is_fan_in():
            start = sum(rows[:slot])
            return grad[start: start + rows[slot]].contiguous(), None, None, None
        return gather_rows(grad.contiguous(), rows, comm.gather_pg), None, None, None
