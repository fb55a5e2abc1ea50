"""The run's parallel layout, with one owner: each module's grid derived from the layout options and the world size,
the rules every grid must keep (divisibility by the model's shape, the features and devices each dimension works
with), the factors the other rooms divide by, and the one-line description.

A `Layout` holds the per-module `ModuleParallelism` records (the public record providers read in their
`BuildContext`); `check()` is the one call start-up makes: every refusal of a layout, one line naming the option
and a value that works. The memory plan, the step-time model, checkpoints, generation and `mimo plan` ask a
Layout what they need (the rank groups, the lanes, how weights, optimizer state and tokens are split) instead of
reading a dimension's field. A new parallel dimension is a field of `ModuleParallelism` and `LayoutOptions`, its
rules and factors here, and its cost terms in memory/estimate.py and step_time/model.py. The provider's own
refusal of a layout (provider_refusal.py) needs the provider's specs, so the plan asks it after `check()`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field

from mimo.errors import UsageError
from mimo.plugins import LANGUAGE, ModuleParallelism, ModuleShape
from mimo.wording import counted

from ..config import LayoutOptions

GRID_DIMS = ("tp", "cp", "dp", "pp")  # a module's HyperCommGrid, tp varying fastest
EXPERT_DIMS = ("expt_tp", "ep", "expt_dp", "pp")  # its expert view: the same ranks, experts split over EP x expert TP


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _divide(a: int, b: int) -> bool:
    return max(a, b) % min(a, b) == 0


@dataclass(frozen=True)
class Features:
    """What the run asks of its layout besides the sizes: the features and device each dimension must work with."""

    micro_batch_size: int = 1
    sequence_parallel: bool = False
    seq_length: int | None = None  # the LLM's row, where the provider's settings fix one
    pack_sequences: bool = False  # packed (THD) rows from --data
    cuda_graphs: bool = False
    device: str = "auto"
    gpu_only: tuple[str, ...] = ()  # the options given that need a GPU, as typed (run/plan.gpu_only_options)


@dataclass(frozen=True)
class RankGroup:
    """Ranks that hold the same modules and do the same work: what a memory or time estimate is made for."""

    kind: str  # "all ranks", "encoder ranks", "LLM ranks", "LLM stage N"
    ranks: tuple[int, int]  # first and last
    modules: tuple[str, ...]
    stage: int = 0  # the LLM's pipeline stage (0 for encoders and colocated ranks)


@dataclass(frozen=True, eq=False)
class Layout:
    """Each module's grid and what follows from it. `Layout.plan` derives it from the options; a Layout of a bare
    `parallelism` (a candidate, a test's) answers the same questions, without the options' rules."""

    parallelism: dict[str, ModuleParallelism]
    shapes: dict[str, ModuleShape] = field(default_factory=dict)
    features: Features = Features()
    options: LayoutOptions | None = None
    world_size: int | None = None

    @classmethod
    def plan(cls, options: LayoutOptions, world_size: int, shapes: dict[str, ModuleShape],
             features: Features = Features()) -> Layout:
        """The layout the options ask for, not yet checked: the encoders on the first `--encoder-ranks` ranks (all
        of them when colocated) at `--encoder-tp`, the LLM on the rest."""
        k = options.encoder_ranks
        encoder_span, llm_span = ((0, world_size), (0, world_size)) if k == 0 else ((0, k), (k, world_size - k))
        parallelism = {name: ModuleParallelism(*encoder_span, tp=options.encoder_tp)
                       for name in shapes if name != LANGUAGE}
        parallelism[LANGUAGE] = ModuleParallelism(*llm_span, tp=options.llm_tp, pp=options.llm_pp, ep=options.llm_ep,
                                                  expt_tp=options.llm_expt_tp, cp=options.llm_cp)
        return cls(parallelism, shapes, features, options, world_size)

    @classmethod
    def of_run(cls, config, world_size: int, shapes: dict[str, ModuleShape], seq_length: int | None,
               gpu_only: tuple[str, ...] = ()) -> Layout:
        """The layout of a RunConfig's options (`seq_length`: the provider's settings'; `gpu_only`: the options
        given that need a GPU)."""
        perf = config.performance
        features = Features(micro_batch_size=config.training.micro_batch_size,
                            sequence_parallel=perf.sequence_parallel, seq_length=seq_length,
                            pack_sequences=config.data.data is not None and config.data.pack_sequences,
                            cuda_graphs=perf.cuda_graphs, device=config.training.device, gpu_only=gpu_only)
        return cls.plan(config.layout, world_size, shapes, features)

    def replaced(self, **options) -> Layout:
        """The same run with other layout options (`llm_cp=1`: its ranks as data parallelism)."""
        return Layout.plan(dataclasses.replace(self.options, **options), self.world_size, self.shapes, self.features)

    # --- the rules: every refusal of a layout, in the order a run meets them

    def check(self) -> Layout:
        """Raise UsageError, one line naming the option to change and a value that works, on the first rule the
        layout breaks; else return it. For a Layout from `plan` or `of_run` (the rules need the model's shapes)."""
        if self.options is not None:
            self._check_options()
        for name, par in self.parallelism.items():
            _check_module(name, par, self.shapes[name], self.features.sequence_parallel)
        if not self.colocated:
            self._check_bridge()
        elif self.llm.pp > 1:
            self._check_stages_beside_encoders()
        elif self.shared_ranks_exchange:
            self._check_shared_ranks()
        self._check_sequence_split()
        self._check_device()
        return self

    def _check_options(self) -> None:
        layout, world_size, k = self.options, self.world_size, self.options.encoder_ranks
        if not 0 <= k < world_size:
            raise UsageError(f"--encoder-ranks {k} must leave ranks for the LLM in a world of {world_size}: "
                             f"use 0 (colocated) to {world_size - 1}")
        if k == 0 and world_size % layout.llm_tp:  # before the TP the encoders share: a TP that fits comes first
            raise UsageError(f"--llm-tp {layout.llm_tp} does not fit {counted(world_size, 'rank')}: the modules "
                             f"share every rank, so TP must divide the {world_size}; use --llm-tp among "
                             f"{_divisors(world_size)}, or a multiple of {layout.llm_tp} ranks (--nproc-per-node)")
        if k == 0 and world_size % layout.encoder_tp:
            raise UsageError(f"--encoder-tp {layout.encoder_tp} does not fit {counted(world_size, 'rank')}: "
                             f"colocated encoders run on every rank; use --encoder-tp among {_divisors(world_size)}")

    def _check_bridge(self) -> None:
        """Encoder DP and LLM DP must fan out or in evenly: the bridge splits micro-batches by whole samples."""
        llm, encoder = self.llm, self.parallelism[self.encoders[0]]
        e, l, micro_batch_size = encoder.dp, llm.dp, self.features.micro_batch_size
        if max(e, l) % min(e, l):
            total = encoder.num_ranks + llm.num_ranks
            block = llm.tp * llm.cp * llm.pp  # an LLM lane's ranks
            fits = [n for n in range(1, total) if n % encoder.tp == 0 and (total - n) % block == 0
                    and _divide(n // encoder.tp, (total - n) // block)]
            hint = f"try --encoder-ranks {fits[0]}" if fits else "change --encoder-ranks or the TP/PP sizes"
            raise UsageError(f"encoder DP {e} and LLM DP {l} must divide one another for the bridge: {hint}")
        if e > l and micro_batch_size % (e // l):
            raise UsageError(f"--micro-batch-size {micro_batch_size} cannot be split over the {e // l} encoder "
                             f"ranks that feed each LLM lane: use a multiple of {e // l}")

    def _check_shared_ranks(self) -> None:
        """Colocated encoders at a TP other than the LLM's: their embeddings change hands between the two
        data-parallel layouts of the same ranks (core/parallel/shared_ranks.py)."""
        llm, encoder, f = self.llm, self.parallelism[self.encoders[0]], self.features
        e, l, fix = encoder.dp, llm.dp, f"or --encoder-tp {llm.tp} (the LLM's)"
        if llm.cp > 1:
            raise UsageError(f"--llm-cp {llm.cp} with colocated encoders at their own TP is not supported (the "
                             f"encoders would split samples the CP ranks share): set --encoder-tp {llm.tp}")
        if not _divide(e, l):
            raise UsageError(f"colocated encoder DP {e} and LLM DP {l} must divide one another: choose --encoder-tp "
                             f"among {_divisors(encoder.num_ranks)} dividing or multiplying --llm-tp {llm.tp}, {fix}")
        if e > l and f.micro_batch_size % (e // l):
            raise UsageError(f"--micro-batch-size {f.micro_batch_size} cannot be split over the {e // l} encoder "
                             f"ranks that share each LLM lane: use a multiple of {e // l}, {fix}")
        if e < l and f.pack_sequences:
            raise UsageError(f"--pack-sequences with colocated encoders at a larger TP than the LLM's is not "
                             f"supported (packed rows are not cut into lanes): {fix}")

    def _check_stages_beside_encoders(self) -> None:
        """The LLM's stages on the encoders' ranks: each stage's ranks encode a share of their lane, and the
        embeddings reach stage 0 (core/forward/encoders_beside_stages.py)."""
        llm, encoder, mbs = self.llm, self.parallelism[self.encoders[0]], self.features.micro_batch_size
        if encoder.tp != llm.tp or llm.cp > 1:
            raise UsageError(f"--llm-pp {llm.pp} with colocated encoders needs them at the LLM's TP and no CP: set "
                             f"--encoder-tp {llm.tp} and --llm-cp 1, or give the encoders ranks of their own with "
                             f"--encoder-ranks")
        if mbs % llm.pp:
            raise UsageError(f"--micro-batch-size {mbs} cannot be split over the LLM's {llm.pp} stages, whose ranks "
                             f"encode a share of each micro-batch: use a multiple of {llm.pp}")

    def _check_sequence_split(self) -> None:
        """What context parallelism needs of the run (context_parallel.py says why)."""
        llm, f = self.llm, self.features
        if llm.cp == 1:
            return
        if f.cuda_graphs:
            # measured on 2 H200s (docs/parallelism.md): the slice trained alike with and without graphs, as fast,
            # and the run with graphs did not exit after its last iteration
            raise UsageError(f"--llm-cp {llm.cp} with --cuda-graphs is not supported yet (a CP run with graphs did "
                             f"not end after its last iteration, and was no faster); leave --cuda-graphs off")
        if f.pack_sequences and not splits_packed_rows(f.device):
            raise UsageError(f"--llm-cp {llm.cp} with --pack-sequences needs transformer-engine on GPUs (its split "
                             f"of packed rows; the CPU's backends have none): run on GPUs with mimo[te] installed, "
                             f"or without --pack-sequences")
        multiple = self.shard_multiple
        if f.seq_length is not None and f.seq_length % multiple:
            what = f"2 x CP x TP = 2 x {llm.cp} x {llm.tp}" if multiple != 2 * llm.cp else f"2 x CP = 2 x {llm.cp}"
            fits = -(-f.seq_length // multiple) * multiple
            raise UsageError(f"--llm-cp {llm.cp}: the sequence length {f.seq_length} must be a multiple of {what} = "
                             f"{multiple} (the load-balanced split); use --set seq_length={fits}")

    def _check_device(self) -> None:
        """What a --device cpu run's workers would refuse (or fail at) after start-up (docs/cpu.md). Only for an
        explicit --device cpu: a plan made on a CPU host with --device auto may be for GPUs."""
        if self.features.device != "cpu":
            return
        if self.features.gpu_only:
            raise UsageError(f"{self.features.gpu_only[0]} needs a GPU; this run is on the CPU")
        if self.features.sequence_parallel:
            raise UsageError("--sequence-parallel needs transformer-engine's norms, which need a GPU: drop it on the "
                             "CPU (an LLM with experts then keeps --llm-tp 1 and splits them with --llm-ep)")
        if self.llm.expt_tp > 1:  # megatron-core's expert-TP gather asks CUDA for its device in backward
            raise UsageError(f"--llm-expt-tp {self.llm.expt_tp} does not run on the CPU: split the experts with "
                             f"--llm-ep instead")

    def generation_refusal(self) -> str | None:
        """Why decoding cannot run on this layout (generation/decoder.py decodes colocated, one stage), or None."""
        if not self.colocated:
            return "generation needs every module on every rank (colocated, --encoder-ranks 0)"
        if self.llm.pp > 1:
            return "generation needs the LLM in one pipeline stage (--llm-pp 1)"
        if self.shared_ranks_exchange:
            return f"generation needs the encoders at the LLM's TP (--encoder-tp {self.llm.tp})"
        return None

    def optimizer_resharding(self, saved_dp: dict[str, int]) -> tuple[str, int, int] | None:
        """The first module whose DP differs from `saved_dp` ({module: DP} a checkpoint records): (module, saved,
        now); distributed-optimizer state sharded per DP rank loads only at its own DP."""
        for name, par in self.parallelism.items():
            if saved_dp[name] != par.dp:
                return name, saved_dp[name], par.dp
        return None

    def rng_resharding(self, saved_layout: dict) -> str | None:
        """Why a checkpoint's RNG state (one per module's pipeline x tensor rank) cannot load on this layout, or
        None; `saved_layout` {module: its ModuleParallelism fields} as a checkpoint records it."""
        for name, par in self.parallelism.items():
            saved = saved_layout.get(name, {})
            if (saved.get("tp"), saved.get("pp")) != (par.tp, par.pp):
                return (f"the checkpoint's RNG state is per {name} TP{saved.get('tp')} x PP{saved.get('pp')} rank, "
                        f"this run has TP{par.tp} x PP{par.pp}: its RNG starts from --seed")
        return None

    # --- the grids and what follows from them

    @property
    def llm(self) -> ModuleParallelism:
        return self.parallelism[LANGUAGE]

    @property
    def encoders(self) -> list[str]:
        return [name for name in self.parallelism if name != LANGUAGE]

    @property
    def lanes(self) -> int:
        """The LLM's data-parallel lanes: each reads its own micro-batches."""
        return self.llm.dp

    @property
    def colocated(self) -> bool:
        """Every module on every rank."""
        return len({(p.first_rank, p.num_ranks) for p in self.parallelism.values()}) == 1

    @property
    def shared_ranks_exchange(self) -> bool:
        """Colocated encoders whose data parallelism differs from the LLM's (their own --encoder-tp): each rank
        reads its encoders' samples and the LLM's rows and the embeddings change hands (shared_ranks.py)."""
        return self.colocated and any(self.parallelism[n].tp != self.llm.tp for n in self.encoders)

    @property
    def stages_beside_encoders(self) -> bool:
        """The LLM's pipeline stages on the colocated encoders' ranks (core/forward/encoders_beside_stages.py)."""
        return self.colocated and self.llm.pp > 1

    @property
    def encoders_read_own_samples(self) -> bool:
        """Colocated encoders that read other samples than the LLM's lane: at a TP of their own, or beside the
        LLM's pipeline stages (each stage's ranks encode a share of their lane)."""
        return self.shared_ranks_exchange or self.stages_beside_encoders

    @property
    def ranks(self) -> int:
        return len({r for p in self.parallelism.values() for r in p.ranks})

    def shares_llm_ranks(self, name: str) -> bool:
        return (self.parallelism[name].first_rank, self.parallelism[name].num_ranks) == \
            (self.llm.first_rank, self.llm.num_ranks)

    def groups(self) -> list[RankGroup]:
        """The kinds of rank: all ranks when colocated; else each encoder grid's ranks (the multimodule
        pipeline's first stage), then each of the LLM's pipeline stages (with the encoders, colocated)."""
        llm = self.llm
        if self.colocated and llm.pp == 1:
            return [RankGroup("all ranks", (llm.first_rank, llm.ranks[-1]), (*self.encoders, LANGUAGE))]
        out, by_grid = [], {}
        for name in self.encoders:
            par = self.parallelism[name]
            by_grid.setdefault((par.first_rank, par.num_ranks), []).append(name)
        if not self.colocated:
            for (first, count), names in by_grid.items():
                out.append(RankGroup("encoder ranks", (first, first + count - 1), tuple(names)))
        per_stage, beside = llm.num_ranks // llm.pp, tuple(self.encoders) if self.colocated else ()
        for stage in range(llm.pp):
            first = llm.first_rank + stage * per_stage
            kind = "LLM ranks" if llm.pp == 1 else f"LLM stage {stage}"
            out.append(RankGroup(kind, (first, first + per_stage - 1), (*beside, LANGUAGE), stage))
        return out

    def stages(self, name: str) -> int:
        """Pipeline stages a module's layers split into (the LLM's PP; encoders are one stage)."""
        return self.parallelism[name].pp

    def weight_shards(self, name: str) -> tuple[int, int]:
        """(dense, expert) shards of a stage's weights: dense over TP, the experts over EP x expert TP."""
        par = self.parallelism[name]
        return par.tp, par.ep * par.expt_tp

    def optimizer_shards(self, name: str) -> tuple[int, int]:
        """(dense, expert) shards of the distributed optimizer's state: dense over data x context parallelism
        (megatron-core's dp_cp group), the experts over expert DP."""
        par = self.parallelism[name]
        return par.dp * par.cp, par.expt_dp

    def model_shards(self, name: str) -> int:
        """Ranks a module's parameters split over (TP x PP, x EP with experts): `mimo plan`'s per-rank count."""
        par, shape = self.parallelism[name], self.shapes.get(name)
        return par.tp * par.pp * (par.ep if shape is not None and shape.num_experts else 1)

    def sequence_shards(self, name: str) -> int:
        """Ranks a module's sequence splits over: the LLM's merged sequence over CP; encoders are CP 1."""
        return self.parallelism[name].cp

    def sequence_parallel_over(self, name: str, sequence_parallel: bool) -> int:
        """Ranks sequence parallelism splits a module's token-wise activations over: the LLM's TP, where on."""
        par = self.parallelism[name]
        return par.tp if sequence_parallel and par.tp > 1 and name == LANGUAGE else 1

    def batch_share(self, name: str) -> int:
        """A module's rank does 1/this of the global batch's samples' worth of work: the LLM's lane split over CP;
        encoders colocated with it run their lane whole on each of its CP ranks; on ranks of their own their DP's."""
        par = self.parallelism[name]
        if name == LANGUAGE:
            return par.dp * par.cp
        return par.dp // self.llm.cp if self.shares_llm_ranks(name) else par.dp

    @property
    def shard_multiple(self) -> int:
        """The multiple of tokens an LLM row (a packed segment's padded length, with packing) must be for its CP
        (and SP) split; 1 without CP."""
        llm = self.llm
        if llm.cp == 1:
            return 1
        return 2 * llm.cp * (llm.tp if self.features.sequence_parallel and llm.tp > 1 else 1)

    def sequence_split(self) -> tuple[int, int, bool] | None:
        """(LLM TP, CP, sequence parallel) where the LLM's sequence is split (what a backend may lack), else None."""
        llm, sp = self.llm, self.features.sequence_parallel
        if llm.cp == 1 and not (sp and llm.tp > 1):
            return None
        return llm.tp, llm.cp, sp

    def one_hardware_queue(self) -> bool:
        """Whether a module's layers communicate inside (TP or CP): their kernels must run in launch order."""
        return any(p.tp > 1 or p.cp > 1 for p in self.parallelism.values())

    def grid_sizes(self, name: str) -> tuple[list[int], list[int]]:
        """A module's grid sizes over GRID_DIMS and its expert view's over EXPERT_DIMS."""
        par = self.parallelism[name]
        return [par.tp, par.cp, par.dp, par.pp], [par.expt_tp, par.ep, par.expt_dp, par.pp]

    def describe_module(self, name: str) -> str:
        p = self.parallelism[name]
        return (f"{name}: ranks {p.first_rank}-{p.first_rank + p.num_ranks - 1} TP{p.tp} PP{p.pp} DP{p.dp}"
                + (f" CP{p.cp}" if p.cp > 1 else "") + (f" EP{p.ep}" if p.ep > 1 else ""))

    def describe(self) -> str:
        """One line: each module's ranks and sizes."""
        return " | ".join(self.describe_module(name) for name in self.parallelism)


def plan(options: LayoutOptions, world_size: int, shapes: dict[str, ModuleShape], micro_batch_size: int,
         sequence_parallel: bool = False) -> dict[str, ModuleParallelism]:
    """The checked per-module parallelism of `options` (for code that builds a model without a run's Plan)."""
    features = Features(micro_batch_size=micro_batch_size, sequence_parallel=sequence_parallel)
    return Layout.plan(options, world_size, shapes, features).check().parallelism


def splits_packed_rows(device: str) -> bool:
    """Whether a run on `device` can split packed (THD) rows over CP: transformer-engine's
    `thd_get_partitioned_indices` does, on GPUs. A plan for GPUs made on a host without one counts as able: the
    workers make the plan again on their GPU hosts, where this looks for transformer-engine."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return False
    return not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine_torch") is not None


def _check_module(name: str, par: ModuleParallelism, shape: ModuleShape, sequence_parallel: bool) -> None:
    """A module's grid against its ranks and its model's shape."""
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
            raise UsageError(f"{tp_opt} {par.tp} does not divide the {who}'s {count} {what}: use one of "
                             f"{_divisors(count)}")
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
                         f"(megatron-core's MoE layers under TP), or keep --llm-tp 1 and split the experts with "
                         f"--llm-ep")
    for option, size in (("--llm-ep", par.ep), ("--llm-expt-tp", par.expt_tp)):
        if size > 1 and not shape.num_experts:  # --llm-expt-tp was ignored silently
            raise UsageError(f"{option} {size} needs a mixture-of-experts LLM; this provider's LLM has no experts")
    if shape.num_experts and shape.num_experts % par.ep:
        raise UsageError(f"--llm-ep {par.ep} does not divide the LLM's {shape.num_experts} experts: use one of "
                         f"{_divisors(shape.num_experts)}")
    if par.num_ranks % (par.expt_tp * par.ep * par.pp):
        raise UsageError(
            f"LLM has {counted(par.num_ranks, 'rank')}, not divisible by expert TP x EP x PP = {par.expt_tp} x "
            f"{par.ep} x {par.pp}"
        )
