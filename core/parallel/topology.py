"""Rank grids: one megatron-core HyperCommGrid per module, with the process groups the model and optimizer use.

The layout itself (each module's sizes, their rules) is layout.py's, checked before any process group exists;
`build` creates the grids it describes and their groups. No global parallel_state is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from mimo.plugins import LANGUAGE, ModuleParallelism

from .layout import EXPERT_DIMS, GRID_DIMS, Layout

EXPERT_VIEW = "expert"  # the grid view megatron-core's MimoOptimizer reads expert groups from


def data_positions(parallelism: dict[str, ModuleParallelism], rank: int, micro_batch_size: int) -> tuple[int, int]:
    """Which positions of each micro-batch (all lanes side by side) this rank reads: (first, count).

    An LLM rank reads its lane. An encoder rank reads the lanes it feeds through the bridge (the bridge pairs
    encoder DP rank r with LLM DP ranks in order), or its share of one lane when several encoder ranks feed it.
    Colocated encoders at a TP of their own read their samples the same way, and the LLM's rows come from them
    (forward/shared_rank_batches.py); beside the LLM's pipeline stages, each stage's ranks read their share of
    their lane.
    """
    llm, layout = parallelism[LANGUAGE], Layout(parallelism)
    if rank in llm.ranks and not layout.encoders_read_own_samples:
        return _dp_rank(llm, rank) * micro_batch_size, micro_batch_size
    if layout.colocated and llm.pp > 1:  # each stage's ranks encode a share of their lane (encoders_beside_stages)
        share = micro_batch_size // llm.pp
        stage = (rank - llm.first_rank) // (llm.num_ranks // llm.pp)
        return _dp_rank(llm, rank) * micro_batch_size + stage * share, share
    encoder = next(p for name, p in parallelism.items() if name != LANGUAGE and rank in p.ranks)
    r, e, l = _dp_rank(encoder, rank), encoder.dp, llm.dp
    if e <= l:
        lanes = l // e
        return r * lanes * micro_batch_size, lanes * micro_batch_size
    parts = e // l
    share = micro_batch_size // parts
    return (r // parts) * micro_batch_size + (r % parts) * share, share


def _dp_rank(par: ModuleParallelism, rank: int) -> int:
    """DP coordinate of `rank` in a [tp, cp, dp, pp] grid (tp varies fastest)."""
    return (rank - par.first_rank) // (par.tp * par.cp) % par.dp


@dataclass
class Topology:
    """This run's grids and, for the modules this rank holds, their process-group collections."""

    parallelism: dict[str, ModuleParallelism]
    grids: dict
    pg_collections: dict  # module -> ProcessGroupCollection, only for modules on this rank

    def holds(self, module: str) -> bool:
        return module in self.pg_collections

    @property
    def layout(self) -> Layout:
        return Layout(self.parallelism)

    @property
    def colocated(self) -> bool:
        return self.layout.colocated


def is_token_source(topology: Topology) -> bool:
    """One rank per LLM data lane: the last pipeline stage's first TP (and CP) rank."""
    pgc = topology.pg_collections.get(LANGUAGE)
    return pgc is not None and is_loss_source(topology) and pgc.cp.rank() == 0


def is_loss_source(topology: Topology) -> bool:
    """The ranks whose loss sums and token counts add up to their lane's: the last pipeline stage's first TP rank
    of each CP rank (each holds the loss of its part of the sequence)."""
    pgc = topology.pg_collections.get(LANGUAGE)
    if pgc is None:
        return False
    return pgc.pp.rank() == pgc.pp.size() - 1 and pgc.tp.rank() == 0


def is_data_source(topology: Topology) -> bool:
    """The ranks whose data counts add up to the global batch's: each lane's token source; where colocated
    encoders read the samples (Layout.encoders_read_own_samples), each encoder replica's first TP rank."""
    if not topology.layout.encoders_read_own_samples:
        return is_token_source(topology)
    encoder = next(name for name in topology.parallelism if name != LANGUAGE)
    return topology.pg_collections[encoder].tp.rank() == 0


def counted_once(totals, loss_source: bool, data_source: bool):
    """This rank's part of a world sum of `totals` ([loss sum, tokens, *data counts]): the loss and tokens from
    every loss source (under CP each holds its part of the lane's sequence), the data counts from the data sources
    alone (every CP rank of a lane reads the same samples: its token source counts them)."""
    if loss_source and data_source:
        return totals
    part = totals.new_zeros(totals.shape)
    if loss_source:
        part[:2] = totals[:2]
    if data_source:
        part[2:] = totals[2:]
    return part


def build(parallelism: dict[str, ModuleParallelism], backend: str) -> Topology:
    """Create every module's grid and groups. Collective: every rank calls it with the same plan."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    grids, pg_collections, layout = {}, {}, Layout(parallelism)
    shared: dict[ModuleParallelism, object] = {}  # encoders with one layout share one grid
    for name, par in parallelism.items():
        if par in shared and name != LANGUAGE:
            grids[name] = shared[par]
        else:
            sizes, expert_sizes = layout.grid_sizes(name)
            grid = HyperCommGrid(sizes, list(GRID_DIMS), par.first_rank, backend)
            grid.register_view(EXPERT_VIEW, expert_sizes, list(EXPERT_DIMS), shared_dims=["pp"])
            for dims in (["tp"], ["cp"], ["pp"], ["dp"], ["dp", "cp"], ["tp", "cp"], ["tp", "pp"], ["tp", "dp"],
                         ["tp", "dp", "cp"], ["tp", "cp", "dp", "pp"]):
                grid.create_pg(dims)
            for dims in (["ep"], ["expt_tp"], ["expt_dp"], ["expt_tp", "ep"], ["expt_tp", "ep", "pp"]):
                grid.create_pg(dims, view=EXPERT_VIEW)
            grids[name] = shared[par] = grid
    for name, grid in grids.items():
        embedding_groups = _embedding_groups(grid) if name == LANGUAGE else (None, None)
        if grid.is_current_rank_in_grid():
            pg_collections[name] = _pg_collection(grid, *embedding_groups)
    return Topology(parallelism, grids, pg_collections)


def _embedding_groups(grid):
    """The word- and position-embedding groups of this rank's pipeline (first and last stage; first stage).

    Collective over the world: every rank creates every pipeline's groups.
    """
    mine = (None, None)
    for pp_ranks in grid.get_rank_enum("pp"):
        word = dist.new_group(ranks=sorted({pp_ranks[0], pp_ranks[-1]}))
        position = dist.new_group(ranks=[pp_ranks[0]])
        if dist.get_rank() in pp_ranks:
            mine = (word if dist.get_rank() in (pp_ranks[0], pp_ranks[-1]) else None,
                    position if dist.get_rank() == pp_ranks[0] else None)
    return mine


def _pg_collection(grid, embd, pos_embd):
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection()
    pgc.tp, pgc.cp, pgc.pp, pgc.dp = (grid.get_pg(d) for d in ("tp", "cp", "pp", "dp"))
    pgc.dp_cp = pgc.intra_dp_cp = grid.get_pg(["dp", "cp"])
    pgc.tp_cp = grid.get_pg(["tp", "cp"])
    pgc.tp_dp = grid.get_pg(["tp", "dp"])
    pgc.tp_dp_cp = grid.get_pg(["tp", "dp", "cp"])
    pgc.mp = grid.get_pg(["tp", "pp"])
    pgc.ep = grid.get_pg("ep", view=EXPERT_VIEW)
    pgc.expt_tp = grid.get_pg("expt_tp", view=EXPERT_VIEW)
    pgc.expt_dp = pgc.intra_expt_dp = grid.get_pg("expt_dp", view=EXPERT_VIEW)
    pgc.tp_ep = grid.get_pg(["expt_tp", "ep"], view=EXPERT_VIEW)
    pgc.tp_ep_pp = grid.get_pg(["expt_tp", "ep", "pp"], view=EXPERT_VIEW)
    pgc.embd, pgc.pos_embd = embd, pos_embd
    return pgc
