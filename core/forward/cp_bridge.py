"""The bridge from the encoders' grid to an LLM grid with context parallelism (`--llm-cp` with `--encoder-ranks`).

megatron-core 0.19.2's BridgeCommunicator asserts CP 1 on both grids. The LLM side needs nothing new in the
forward: the bridge's leader (the first TP x CP rank of a lane's first stage) already broadcasts what it receives
to every TP x CP rank of that stage, and every CP rank needs the whole encoder output, since MimoModel merges it
into the full sequence and only then splits the merged sequence over CP. In the backward each CP rank's gradient
for that output is its part of the sequence's contribution alone: the CP ranks' gradients are summed over the LLM's
CP group before the leader sends them back. The encoders stay CP 1.

One module with one job, replaceable when a megatron-core release bridges CP itself.
"""

from __future__ import annotations

from functools import cache

import torch.distributed as dist


def pipeline_communicator(grids: dict, topology: dict, config, *, dim_mapping: dict, module_output_ndim: dict):
    """megatron-core's MultiModulePipelineCommunicator for `grids` and `topology` (module -> modules it feeds),
    its bridges accepting a destination grid with CP > 1."""
    return _communicator_class()(grids, topology, config, dim_mapping=dim_mapping,
                                 module_output_ndim=module_output_ndim)


@cache
def _communicator_class():
    from megatron.core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator

    bridge_class = _bridge_class()

    class ContextParallelCommunicator(MultiModulePipelineCommunicator):
        def _build_bridge_comms(self):
            for source, source_grid in self.module_to_grid_map.items():
                for dest in self.topology[source]:
                    self.bridge_comms.append(bridge_class(
                        source_grid, self.module_to_grid_map[dest], dim_mapping=self.dim_mapping,
                        comm_dtype=self.config.pipeline_dtype, src_module_name=source, dest_module_name=dest,
                        tensor_ndim=self.module_output_ndim.get(source, 3)))

    return ContextParallelCommunicator


@cache
def _bridge_class():
    from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

    class ContextParallelBridge(BridgeCommunicator):
        """A bridge whose destination may have CP > 1: its CP ranks' gradients summed before they go back."""

        def __init__(self, src_grid, dest_grid, **kwargs):
            # The bridge reads a grid to enumerate its TP x CP blocks and their leaders: the grid with CP folded
            # into TP has the same ones and passes the CP 1 assertion; the real grid is kept for the rest.
            super().__init__(src_grid, cp_folded_into_tp(dest_grid), **kwargs)
            self.dest_grid = dest_grid
            on_dest = self.is_current_rank_in_grid(dest_grid)
            self._dest_cp = dest_grid.get_pg("cp") if on_dest and _size(dest_grid, "cp") > 1 else None

        def send_backward(self, grad_tensor):
            super().send_backward(self._summed_over_cp(grad_tensor))

        def send_backward_recv_forward(self, grad_tensor, forward_shape=None):
            return super().send_backward_recv_forward(self._summed_over_cp(grad_tensor), forward_shape)

        def _summed_over_cp(self, grad):
            # every first-stage rank of the LLM calls this with its gradient, so the CP group's ranks meet here
            if self._dest_cp is not None and grad is not None:
                dist.all_reduce(grad, group=self._dest_cp)
            return grad

    return ContextParallelBridge


def cp_folded_into_tp(grid):
    """`grid` (dims tp, cp, ... with cp right after tp) as a grid of CP 1 whose TP is TP x CP: the same ranks in
    the same order (TP varies fastest, then CP), no process groups of its own. `grid` itself when its CP is 1."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    tp, cp = grid.dim_names.index("tp"), grid.dim_names.index("cp")
    if grid.shape[cp] == 1:
        return grid
    if cp != tp + 1:
        raise ValueError(f"the bridge needs a grid's cp right after its tp, got dims {grid.dim_names}")
    shape = list(grid.shape)
    shape[tp], shape[cp] = shape[tp] * shape[cp], 1
    return HyperCommGrid(shape, list(grid.dim_names), grid.rank_offset, grid.backend)


def _size(grid, dim: str) -> int:
    return grid.shape[grid.dim_names.index(dim)]
