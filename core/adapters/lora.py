"""One low-rank adapter: `delta(x) = scale * B A dropout(x)` beside a frozen linear, sharded over that linear's
tensor-parallel ranks as its weight is.

* column-parallel base (output split over TP): A [rank, in] is replicated, B [out / tp, rank] split like the
  output. `A x` goes through megatron-core's copy-to-TP region, whose backward sums the partial gradients of
  `A x` from every rank's B shard, so A's gradient is whole and equal on every rank; with sequence parallelism
  `A x` is taken on the rank's sequence chunk and gathered (A's gradient is then summed over TP where megatron-core
  sums its sequence-parallel norms', `sequence_parallel` set).
* row-parallel base (input split over TP, output summed): A [rank, in / tp] is split like the input, B [out, rank]
  replicated. The rank-r partial sums `A x` are summed over TP (or reduce-scattered over the sequence) before B,
  so the adapter's output is added after the base layer's own reduction, whole on every rank.
* no TP group (one rank, or experts whose communication the token dispatcher does): no communication.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

COLUMN, ROW = "column", "row"


@dataclass(frozen=True)
class Sharding:
    """How the base linear is split: `mode` column or row, its TP group (None: no communication), whether its
    input or output is sequence-parallel, whether it gathers its output, whether its input arrives split."""

    mode: str
    in_features: int  # this rank's
    out_features: int  # this rank's
    tp_group: object = None
    sequence_parallel: bool = False
    gather_output: bool = False
    input_is_parallel: bool = True

    @property
    def tp_size(self) -> int:
        return self.tp_group.size() if self.tp_group is not None else 1

    @property
    def tp_rank(self) -> int:
        return self.tp_group.rank() if self.tp_group is not None else 0


class LoRA(torch.nn.Module):
    """The adapter's two matrices, `a` [rank, in] and `b` [out, rank] (this rank's shards), and its forward."""

    def __init__(self, sharding: Sharding, rank: int, scale: float, dropout: float, dtype: torch.dtype,
                 device: torch.device, expert: bool = False, row_parts: list[int] | None = None):
        """`row_parts`: this rank's output rows of a column-parallel base that stacks several outputs (Mamba's
        in_proj, a gated MLP's fc1): B's rows are saved part by part as the base weight's are, so that a checkpoint
        reshards over another TP size."""
        super().__init__()
        self.row_parts = row_parts if row_parts and len(row_parts) > 1 and sharding.mode == COLUMN else None
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.sharding, self.scale, self.rank = sharding, scale, rank
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else None
        self.a = torch.nn.Parameter(torch.zeros(rank, sharding.in_features, dtype=dtype, device=device))
        self.b = torch.nn.Parameter(torch.zeros(sharding.out_features, rank, dtype=dtype, device=device))
        split, whole = (self.b, self.a) if sharding.mode == COLUMN else (self.a, self.b)
        set_tensor_model_parallel_attributes(split, True, 0 if sharding.mode == COLUMN else 1, 1)
        if sharding.sequence_parallel and sharding.tp_size > 1:
            whole.sequence_parallel = True  # its gradient is a partial sum over this rank's sequence chunk
        for param in (self.a, self.b):
            param.allreduce = not expert  # megatron-core DDP: expert parameters reduce over expert-DP only

    def initialize(self, seed: int, name: str) -> None:
        """A from a generator of its own, seeded by `seed` and the layer's layout-independent `name`: every layout
        draws the same global A and takes its shard; B zero, so the adapted model starts as the base model."""
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        s = self.sharding
        full_in = s.in_features * (s.tp_size if s.mode == ROW else 1)
        bound = 1.0 / math.sqrt(full_in)  # kaiming-uniform with a = sqrt(5), as torch's Linear and peft's LoRA
        full = torch.empty(self.rank, full_in).uniform_(-bound, bound, generator=generator)
        if s.mode == ROW:
            full = full[:, s.tp_rank * s.in_features:(s.tp_rank + 1) * s.in_features]
        with torch.no_grad():
            self.a.copy_(full)
            self.b.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's output for the base linear's input `x`, laid out as the base linear's output."""
        from megatron.core.tensor_parallel import mappings

        s, group = self.sharding, self.sharding.tp_group
        if s.mode == ROW and group is not None and not s.input_is_parallel:
            x = mappings.scatter_to_tensor_model_parallel_region(x, group=group)
        if self.dropout is not None:
            x = self.dropout(x)
        h = F.linear(x.to(self.a.dtype), self.a)
        if group is not None and s.mode == COLUMN:
            h = (mappings.gather_from_sequence_parallel_region(h, group=group) if s.sequence_parallel
                 else mappings.copy_to_tensor_model_parallel_region(h, group=group))
        elif group is not None:
            h = (mappings.reduce_scatter_to_sequence_parallel_region(h, group=group) if s.sequence_parallel
                 else mappings.reduce_from_tensor_model_parallel_region(h, group=group))
        out = F.linear(h, self.b) * self.scale
        if group is not None and s.mode == COLUMN and s.gather_output:
            out = mappings.gather_from_tensor_model_parallel_region(out, group=group)
        return out

    def borrow(self, matrix: str, param: torch.nn.Parameter) -> None:
        """Use `param`, another module's parameter, as matrix `matrix` ("a" or "b") without owning it: it leaves
        this module's parameters, state dict and checkpoint (shared-outer experts, experts.py: one half shared by a
        layer's experts, held by the experts module)."""
        del self._parameters[matrix]
        self.__dict__[matrix] = param

    def borrowed(self) -> str | None:
        """The matrix this adapter uses without owning it, if any."""
        return next((m for m in ("a", "b") if m not in self._parameters and m in self.__dict__), None)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """scale * B A in fp32: what merging adds to this rank's shard of the base weight."""
        return self.scale * (self.b.float() @ self.a.float())

    def sharded_state_dict(self, prefix: str, sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """`a` and `b` as megatron-core ShardedTensors, split over TP as in the forward (the base linear's helper
        would take both for replicated tensors); replicas numbered as megatron-core numbers its layers'."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        s = self.sharding
        group = (metadata or {}).get("dp_cp_group")
        dp_rank = group.rank() if group is not None else 0
        split = "b" if s.mode == COLUMN else "a"
        state = {}
        for name, tensor in self._parameters.items():  # a borrowed matrix is saved by its owner
            if name == split:
                axis = (len(sharded_offsets) + (0 if s.mode == COLUMN else 1), s.tp_rank, s.tp_size)
                offsets, replica = (*sharded_offsets, axis), (0, 0, dp_rank)
            else:
                offsets, replica = tuple(sharded_offsets), (0, s.tp_rank, dp_rank)
            state[f"{prefix}{name}"] = ShardedTensor.from_rank_offsets(
                f"{prefix}{name}", tensor, *offsets, replica_id=replica, prepend_axis_num=len(sharded_offsets))
        if self.row_parts is not None and f"{prefix}b" in state and sum(self.row_parts) == self.b.shape[0]:
            from megatron.core.ssm.utils import _split_tensor_factory

            state[f"{prefix}b"] = _split_tensor_factory(state[f"{prefix}b"], list(self.row_parts),
                                                        [f"part{i}" for i in range(len(self.row_parts))], 0)
        return state
