"""Rank grids: one megatron-core HyperCommGrid per module, with the process groups the model and optimizer use.

`plan` turns layout options into per-module parallelism and validates it against the model's shape before any
process group exists; `build` then creates the grids and groups. No global parallel_state is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from mimo.errors import UsageError
from mimo.plugins import LANGUAGE, ModuleParallelism, ModuleShape
from mimo.wording import counted

from ..config import LayoutOptions

EXPERT_VIEW = "expert"  # the grid view megatron-core's MimoOptimizer reads expert groups from


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def plan(layout: LayoutOptions, world_size: int, shapes: dict[str, ModuleShape],
         micro_batch_size: int, sequence_parallel: bool = False) -> dict[str, ModuleParallelism]:
    """Per-module parallelism for this run, or a UsageError naming the option to change and a value that works."""
    k = layout.encoder_ranks
    if not 0 <= k < world_size:
        raise UsageError(f"--encoder-ranks {k} must leave ranks for the LLM in a world of {world_size}: "
                         f"use 0 (colocated) to {world_size - 1}")
    if k == 0 and world_size % layout.llm_tp:  # before the TP the encoders share: a TP that fits comes first
        raise UsageError(f"--llm-tp {layout.llm_tp} does not fit {counted(world_size, 'rank')}: the modules share "
                         f"every rank, so TP must divide the {world_size}; use --llm-tp among {_divisors(world_size)}, "
                         f"or a multiple of {layout.llm_tp} ranks (--nproc-per-node)")
    if k == 0 and layout.encoder_tp != layout.llm_tp:
        raise UsageError(f"colocated modules share the LLM's TP: set --encoder-tp {layout.llm_tp}, or give the "
                         f"encoders ranks of their own with --encoder-ranks")
    if k == 0 and layout.llm_pp > 1:
        raise UsageError("--llm-pp > 1 needs the encoders on ranks of their own: set --encoder-ranks")
    encoder_span, llm_span = ((0, world_size), (0, world_size)) if k == 0 else ((0, k), (k, world_size - k))
    parallelism = {
        name: ModuleParallelism(*encoder_span, tp=layout.encoder_tp) for name in shapes if name != LANGUAGE
    }
    parallelism[LANGUAGE] = ModuleParallelism(
        *llm_span, tp=layout.llm_tp, pp=layout.llm_pp, ep=layout.llm_ep, expt_tp=layout.llm_expt_tp, cp=layout.llm_cp
    )
    for name, par in parallelism.items():
        _check_module(name, par, shapes[name], sequence_parallel)
    if k:
        _check_bridge(parallelism, micro_batch_size)
    return parallelism


def _check_bridge(parallelism: dict[str, ModuleParallelism], micro_batch_size: int) -> None:
    """Encoder DP and LLM DP must fan out or in evenly: the bridge splits micro-batches by whole samples."""
    llm = parallelism[LANGUAGE]
    encoder = next(p for name, p in parallelism.items() if name != LANGUAGE)
    e, l = encoder.dp, llm.dp
    if max(e, l) % min(e, l):
        total = encoder.num_ranks + llm.num_ranks
        block = llm.tp * llm.cp * llm.pp  # an LLM lane's ranks
        fits = [n for n in range(1, total) if n % encoder.tp == 0 and (total - n) % block == 0
                and _divide(n // encoder.tp, (total - n) // block)]
        hint = f"try --encoder-ranks {fits[0]}" if fits else "change --encoder-ranks or the TP/PP sizes"
        raise UsageError(f"encoder DP {e} and LLM DP {l} must divide one another for the bridge: {hint}")
    if e > l and micro_batch_size % (e // l):
        raise UsageError(f"--micro-batch-size {micro_batch_size} cannot be split over the {e // l} encoder ranks "
                         f"that feed each LLM lane: use a multiple of {e // l}")


def _divide(a: int, b: int) -> bool:
    return max(a, b) % min(a, b) == 0


def data_positions(parallelism: dict[str, ModuleParallelism], rank: int, micro_batch_size: int) -> tuple[int, int]:
    """Which positions of each micro-batch (all lanes side by side) this rank reads: (first, count).

    An LLM rank reads its lane. An encoder rank reads the lanes it feeds through the bridge (the bridge pairs
    encoder DP rank r with LLM DP ranks in order), or its share of one lane when several encoder ranks feed it.
    """
    llm = parallelism[LANGUAGE]
    if rank in llm.ranks:
        return _dp_rank(llm, rank) * micro_batch_size, micro_batch_size
    encoder = next(p for p in parallelism.values() if rank in p.ranks)
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


def _check_module(name: str, par: ModuleParallelism, shape: ModuleShape, sequence_parallel: bool) -> None:
    is_llm = name == LANGUAGE
    tp_opt, who = ("--llm-tp", "LLM") if is_llm else ("--encoder-tp", f"encoder '{name}'")
    if par.num_ranks % (par.tp * par.pp):
        raise UsageError(
            f"{who} has {counted(par.num_ranks, 'rank')}, not divisible by TP x PP = {par.tp} x {par.pp}: "
            f"choose {tp_opt}{' x --llm-pp' if is_llm else ''} among {_divisors(par.num_ranks)}"
        )
    if par.num_ranks % (par.tp * par.cp * par.pp):
        raise UsageError(f"{who} has {counted(par.num_ranks, 'rank')}, not divisible by TP x CP x PP = {par.tp} x "
                         f"{par.cp} x {par.pp}: choose --llm-cp among {_divisors(par.num_ranks // (par.tp * par.pp))}")
    for count, what in ((shape.num_attention_heads, "attention heads"), (shape.num_query_groups, "query groups")):
        if count and count % par.tp:
            raise UsageError(f"{tp_opt} {par.tp} does not divide the {who}'s {count} {what}: use one of {_divisors(count)}")
    if shape.vocab_size and shape.vocab_size % par.tp:
        multiple = -(-shape.vocab_size // par.tp) * par.tp
        raise UsageError(f"{tp_opt} {par.tp} does not divide the {who}'s vocabulary of {shape.vocab_size} "
                         f"(megatron-core splits the embedding evenly over TP): pad it to {multiple}, or use "
                         f"{tp_opt} among {_divisors(shape.vocab_size)}")
    if par.pp > 1 and shape.num_layers % par.pp:
        raise UsageError(f"--llm-pp {par.pp} does not divide the LLM's {counted(shape.num_layers, 'layer')}: use one "
                         f"of {_divisors(shape.num_layers)}")
    if is_llm and shape.num_experts and par.tp > 1 and not sequence_parallel:
        raise UsageError(f"--llm-tp {par.tp} with a mixture-of-experts LLM needs --sequence-parallel "
                         f"(megatron-core's MoE layers under TP), or keep --llm-tp 1 and split the experts with --llm-ep")
    for option, size in (("--llm-ep", par.ep), ("--llm-expt-tp", par.expt_tp)):
        if size > 1 and not shape.num_experts:  # --llm-expt-tp was ignored silently
            raise UsageError(f"{option} {size} needs a mixture-of-experts LLM; this provider's LLM has no experts")
    if shape.num_experts and shape.num_experts % par.ep:
        raise UsageError(f"--llm-ep {par.ep} does not divide the LLM's {shape.num_experts} experts: use one of {_divisors(shape.num_experts)}")
    if par.num_ranks % (par.expt_tp * par.ep * par.pp):
        raise UsageError(
            f"LLM has {counted(par.num_ranks, 'rank')}, not divisible by expert TP x EP x PP = {par.expt_tp} x "
            f"{par.ep} x {par.pp}"
        )


@dataclass
class Topology:
    """This run's grids and, for the modules this rank holds, their process-group collections."""

    parallelism: dict[str, ModuleParallelism]
    grids: dict
    pg_collections: dict  # module -> ProcessGroupCollection, only for modules on this rank

    def holds(self, module: str) -> bool:
        return module in self.pg_collections

    @property
    def colocated(self) -> bool:
        return len({(p.first_rank, p.num_ranks) for p in self.parallelism.values()}) == 1


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


def counted_once(totals, loss_source: bool, token_source: bool):
    """This rank's part of a world sum of `totals` ([loss sum, tokens, *data counts]): the loss and tokens from
    every loss source (under CP each holds its part of the lane's sequence), the data counts from the lane's token
    source alone (every CP rank reads the same samples)."""
    if token_source:  # a lane's token source is one of its loss sources
        return totals
    part = totals.new_zeros(totals.shape)
    if loss_source:
        part[:2] = totals[:2]
    return part


def build(parallelism: dict[str, ModuleParallelism], backend: str) -> Topology:
    """Create every module's grid and groups. Collective: every rank calls it with the same plan."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    grids, pg_collections = {}, {}
    shared: dict[ModuleParallelism, object] = {}  # encoders with one layout share one grid
    for name, par in parallelism.items():
        if par in shared and name != LANGUAGE:
            grids[name] = shared[par]
        else:
            grid = HyperCommGrid([par.tp, par.cp, par.dp, par.pp], ["tp", "cp", "dp", "pp"], par.first_rank, backend)
            grid.register_view(EXPERT_VIEW, [par.expt_tp, par.ep, par.expt_dp, par.pp],
                               ["expt_tp", "ep", "expt_dp", "pp"], shared_dims=["pp"])
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
