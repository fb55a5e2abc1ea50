"""`mimo plan --suggest --gpus N`: the layouts of N GPUs that topology validation accepts and whose memory
estimate fits (`fitting`); `suggest` orders them cheapest communication first, then most headroom, the order
core/step_time/advisor.py keeps where the provider's FLOPs cannot time them.

Every split is tried: colocated and each number of encoder ranks, the encoders' TP (colocated too: at the LLM's
or one of their own), the LLM's TP (with sequence parallelism for an MoE LLM), PP (colocated too: its stages
beside the encoders) and EP, and the LLM's CP, colocated or on its own ranks; each checked as the
plan checks a layout given to it (core/parallel/layout.py's `Layout.check`: for CP the sequence a multiple of
2 x CP (x TP under SP), packed rows only where transformer-engine splits them, no --cuda-graphs), and none the
provider refuses (a backend without sequence or context parallelism: core/parallel/provider_refusal.py). Each
layout takes the first of these option sets that fits: as given, then with the distributed optimizer, then
recomputing the LLM selectively, then fully.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mimo.errors import UsageError

from . import estimate as memory
from ..parallel import topology
from ..parallel.layout import Layout
from ..parallel.provider_refusal import provider_refusal
from ..config import LayoutOptions
from .estimate import GIB
from .fit import encoder_rows

# (distributed optimizer, LLM recompute) in the order tried; "as given" keeps the run's own options
VARIANTS = ((None, None), (True, None), (True, "selective"), (True, "full"))
RECOMPUTE_COST = {"none": 0, "selective": 1, "full": 3}


@dataclass
class Suggestion:
    layout: LayoutOptions
    sequence_parallel: bool
    distributed_optimizer: bool
    recompute: str  # the LLM's
    num_microbatches: int
    largest_gib: float  # the largest rank estimate
    headroom_gib: float
    cost: float  # a rough communication cost: TP and PP over EP, recomputation's extra forward
    parallelism: dict = field(default_factory=dict)  # each module's grid
    options: memory.Options | None = None  # what the estimate that fits was made with
    reason: str = ""  # why this layout's less usual choice (CP), one line

    @property
    def global_batch(self) -> int:
        """Samples per iteration: with no --global-batch-size it follows the layout's LLM data-parallel lanes."""
        return self.options.micro_batch_size * self.num_microbatches * Layout(self.parallelism).lanes

    def options_list(self) -> list[str]:
        """The `mimo run` options this layout sets, each whole (an option and its value)."""
        lo, parts = self.layout, []
        if lo.encoder_ranks:
            parts.append(f"--encoder-ranks {lo.encoder_ranks}")
        if lo.encoder_tp > 1:  # colocated too: without it the encoders run at TP 1 beside any LLM TP
            parts.append(f"--encoder-tp {lo.encoder_tp}")
        parts += [f"--llm-{k} {getattr(lo, 'llm_' + k)}" for k in ("tp", "cp", "pp", "ep")
                  if getattr(lo, "llm_" + k) > 1]
        if self.sequence_parallel:
            parts.append("--sequence-parallel")
        if self.distributed_optimizer:
            parts.append("--use-distributed-optimizer")
        if self.recompute != "none":
            parts.append(f"--recompute {topology.LANGUAGE}={self.recompute}")
        return parts

    def flags(self) -> str:
        return " ".join(self.options_list()) or "(colocated, data parallel only)"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(world: int, shapes: dict) -> list[LayoutOptions]:
    """Every layout of `world` ranks the shapes allow, CP among them (Layout.check then holds each to the rules a
    layout given to `mimo plan` is held to: whether the run's sequence, packing and graphs let CP split it)."""
    llm = shapes[topology.LANGUAGE]
    experts = llm.num_experts or 0
    encoder = next((s for n, s in shapes.items() if n != topology.LANGUAGE), None)
    out = []
    for k in range(world):
        llm_ranks = world - k
        for tp in _divisors(llm_ranks):
            if llm.num_attention_heads % tp or (llm.num_query_groups and llm.num_query_groups % tp):
                continue
            # colocated encoders at the LLM's TP or one of their own (embeddings exchanged on the same ranks)
            encoder_tps = [t for t in _divisors(k or world) if not encoder or encoder.num_attention_heads % t == 0]
            pps = [p for p in _divisors(llm_ranks // tp) if llm.num_layers % p == 0]
            for etp in encoder_tps:
                for pp in pps:
                    # colocated, and on the LLM's own ranks (the bridge sends to CP ranks: core/forward/cp_bridge.py)
                    cps = _divisors(llm_ranks // (tp * pp))
                    for ep in ([e for e in _divisors(experts) if (llm_ranks // pp) % e == 0] if experts else [1]):
                        out += [LayoutOptions(encoder_ranks=k, encoder_tp=etp, llm_tp=tp, llm_pp=pp, llm_ep=ep,
                                              llm_cp=cp) for cp in cps]
    return out


def suggest(plan, world: int, limit_gib: float, top: int = 10) -> list[Suggestion]:
    """The `top` layouts of `world` ranks that fit `limit_gib`, cheapest communication first."""
    return best_first(fitting(plan, world, limit_gib))[:top]


def best_first(found: list[Suggestion]) -> list[Suggestion]:
    """Least communication first, then most headroom."""
    return sorted(found, key=lambda s: (s.cost, -s.headroom_gib))


def fitting(plan, world: int, limit_gib: float) -> list[Suggestion]:
    """Every layout of `world` ranks that fits `limit_gib`, each with the first option set that fits."""
    described = plan.hooks.module_memory(settings=plan.settings)
    if described is None:
        raise UsageError(f"--suggest: provider '{plan.config.provider}' has no module_memory hook, so nothing can "
                         f"be estimated")
    config, t = plan.config, plan.config.training
    base = memory.options_of(plan)
    is_moe = bool(plan.shapes[topology.LANGUAGE].num_experts)
    found = []
    accepted: dict = {}  # (LLM TP, CP, SP) -> whether the provider builds its modules so split
    for layout in candidates(world, plan.shapes):
        sp = config.performance.sequence_parallel or (is_moe and layout.llm_tp > 1)
        run = dataclasses.replace(config, layout=layout, performance=dataclasses.replace(
            config.performance, sequence_parallel=sp))
        try:  # the rules the plan holds a layout given to it to
            laid_out = Layout.of_run(run, world, plan.shapes, getattr(plan.settings, "seq_length", None)).check()
        except UsageError:
            continue
        if not _provider_accepts(plan, laid_out, accepted):
            continue
        parallelism, lanes = laid_out.parallelism, laid_out.lanes
        if t.global_batch_size:
            if t.global_batch_size % (t.micro_batch_size * lanes):
                continue
            microbatches = t.global_batch_size // (t.micro_batch_size * lanes)
        else:
            microbatches = t.num_microbatches or 1
        rows = encoder_rows(parallelism, t.micro_batch_size)
        apart = layout.encoder_ranks > 0  # the pipeline feeds the encoders: no once-per-step pass
        # beside the LLM's stages the encoders run once per step always; at a TP of their own, per micro-batch
        step_encoders = laid_out.stages_beside_encoders or (
            base.step_encoders and not apart and not laid_out.shared_ranks_exchange)
        for distopt, recompute in VARIANTS:
            modes = dict(base.recompute)
            if apart and plan.encoders_recomputed:  # auto recomputed them for that pass only
                modes.update({name: "none" for name in parallelism if name != topology.LANGUAGE})
            if recompute:
                modes[topology.LANGUAGE] = recompute
            options = dataclasses.replace(base, sequence_parallel=sp, num_microbatches=microbatches, recompute=modes,
                                          distributed_optimizer=base.distributed_optimizer or bool(distopt),
                                          step_encoders=step_encoders)
            ranks = memory.estimate(described, parallelism, options, rows)
            largest = max(r.total for r in ranks) / GIB
            if largest <= limit_gib:
                mode = modes.get(topology.LANGUAGE, "none")
                cost = (4 * (layout.llm_tp - 1) + 2 * (layout.llm_pp - 1) + 2 * (layout.encoder_tp - 1)
                        + 2 * (layout.llm_cp - 1) + (1 if layout.llm_ep > 1 else 0) + RECOMPUTE_COST[mode]
                        + (1 if laid_out.encoders_read_own_samples else 0))  # embeddings exchanged on shared ranks
                found.append(Suggestion(layout, sp, options.distributed_optimizer, mode, microbatches, largest,
                                        limit_gib - largest, cost, parallelism, options,
                                        _cp_reason(described, laid_out, options, rows, ranks)))
                break
    return found


def _provider_accepts(plan, layout: Layout, accepted: dict) -> bool:
    """Under CP or sequence parallelism, whether the provider builds its modules so split (a backend may have
    neither), as `mimo plan` checks a layout given to it; asked once per (LLM TP, CP, SP)."""
    key = layout.sequence_split()
    if key is None:
        return True
    if key not in accepted:
        performance = dataclasses.replace(plan.config.performance, sequence_parallel=layout.features.sequence_parallel)
        laid_out = dataclasses.replace(plan, config=dataclasses.replace(plan.config, performance=performance))
        accepted[key] = provider_refusal(laid_out, layout) is None
    return accepted[key]


def _cp_reason(described, layout: Layout, options, rows: dict, ranks: list) -> str:
    """One line for a CP layout: the sequence it splits and the activations per GPU with and without the split."""
    cp = layout.sequence_shards(topology.LANGUAGE)
    if cp == 1:
        return ""
    whole = layout.replaced(llm_cp=1).parallelism  # the same ranks as DP
    without = max(r.term("activations") for r in memory.estimate(described, whole, options, rows)) / GIB
    with_cp = max(r.term("activations") for r in ranks) / GIB
    tokens = described[topology.LANGUAGE].tokens_per_sample

    def gib(x: float) -> str:
        return f"{x:.0f}" if x >= 10 else f"{x:.1f}"

    return (f"splits the {tokens:,.0f}-token sequence over {cp} ranks: activations per GPU {gib(with_cp)} GiB "
            f"instead of {gib(without)}")
