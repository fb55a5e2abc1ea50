"""Per-rank memory estimate of a plan, before anything is built: parameters, gradient buffers, optimizer state,
activations of the micro-batches in flight, and an allowance for the CUDA context and the allocator.

Each kind of rank gets its own estimate: all ranks of a colocated layout (every module, summed), the encoder
ranks and each pipeline stage of the LLM ranks of a heterogeneous one. Inputs are the provider's
`module_memory` description and what mimo configures megatron-core with (core/parallel/model.py,
core/parallel/optim.py): DDP gradient buffers in fp32 (`grad_reduce_in_fp32`), Adam with fp32 main weights under
bf16 (or the precision-aware optimizer's bf16 moments and gradients, --optimizer-precision), the distributed
optimizer sharding main weights and moments over data parallelism (experts over expert data parallelism).
Frozen encoders without adapters keep no activations, frozen routed experts no inputs of their GEMMs."""

from __future__ import annotations

from dataclasses import dataclass, field

from mimo.plugins import ModuleMemory, ModuleParallelism, TokenBytes, Weights

from ..parallel.layout import Layout
from ..parallel.topology import LANGUAGE

GIB = 2 ** 30
CONTEXT_BYTES = 2 * GIB  # CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers
ALLOCATOR_SHARE = 0.12  # the caching allocator's fragmentation (variable shapes: up to 11% on an H100), rounding
TERMS = ("parameters", "gradients", "optimizer", "activations")


@dataclass
class ModuleTerms:
    """One module's share of a rank's memory, in bytes."""

    module: str
    stage: int
    layers: int
    recompute: str
    tokens: float  # tokens of one micro-batch this rank holds for the module
    in_flight: int  # micro-batches whose activations are kept at once
    parameters: float
    gradients: float
    optimizer: float
    activations: float  # kept for backward (all micro-batches in flight) + the largest working set
    parameter_count: float
    working: float = 0.0  # the largest working set: the part of `activations` that only backward through it holds


@dataclass
class RankEstimate:
    """The estimate for one kind of rank."""

    kind: str  # e.g. "all ranks", "encoder ranks", "LLM stage 0"
    ranks: tuple[int, int]
    modules: list[ModuleTerms] = field(default_factory=list)

    def term(self, name: str) -> float:
        return sum(getattr(m, name) for m in self.modules)

    @property
    def allocated(self) -> float:
        """What torch's allocator is asked for at the peak: the sum of the terms."""
        return sum(self.term(t) for t in TERMS)

    @property
    def allowance(self) -> float:
        return CONTEXT_BYTES + ALLOCATOR_SHARE * self.allocated

    @property
    def total(self) -> float:
        return self.allocated + self.allowance

    def largest(self) -> tuple[str, str, float]:
        """(term, module, bytes) of the largest single term."""
        return max(((t, m.module, getattr(m, t)) for m in self.modules for t in TERMS), key=lambda x: x[2])


@dataclass(frozen=True)
class Options:
    """What of the run's options the estimate reads."""

    bf16: bool
    distributed_optimizer: bool
    sequence_parallel: bool
    micro_batch_size: int
    num_microbatches: int
    recompute: dict  # module -> none | selective | full
    frozen: frozenset = frozenset()  # modules with nothing to train (no gradients, no optimizer state)
    encoder_tokens: str | float = "max"  # --image-patches: max, mean or tokens per sample for the encoders
    packed_image_tokens: int | None = None  # packed --data rows: the image placeholders a row carries at most
    step_encoders: bool = False  # --encoder-pass step: the encoders hold every micro-batch's activations at once
    # --lora-rank: every base weight frozen; (rank, --lora-experts, ((module, hidden, experts, body, projection), ...))
    adapters: tuple = ()
    optimizer_precision: str = "fp32"  # --optimizer-precision: fp32, bf16-moments or bf16
    # encoder modules whose encoders train nothing (frozen, no adapters) and so keep no activations for a backward:
    # {module: whether its projection trains nothing either}
    still_encoders: tuple = ()
    still_experts: frozenset = frozenset()  # modules whose routed experts train nothing (frozen, no adapters)


def options_of(plan) -> Options:
    config = plan.config
    frozen = tuple(plan.hooks.frozen_parameters(settings=plan.settings) or ())
    adapters = ()
    if plan.adapter_targets:  # LoRA: the whole base frozen, the adapters train
        frozen, targets, a = ("",), plan.adapter_targets, config.adapters
        adapters = (a.lora_rank, a.lora_experts, tuple(
            (name, shape.hidden_size, shape.num_experts, name in targets, "projection" in targets and name != LANGUAGE)
            for name, shape in plan.shapes.items()))
    still = tuple((name, _still(name, "input_projections", frozen, adapters, projection=True))
                  for name in plan.parallelism if name != LANGUAGE and _still(name, "encoders", frozen, adapters))
    return Options(bf16=config.training.precision == "bf16",
                   distributed_optimizer=config.optimizer.use_distributed_optimizer,
                   sequence_parallel=config.performance.sequence_parallel,
                   micro_batch_size=config.training.micro_batch_size, num_microbatches=plan.num_microbatches,
                   recompute={name: config.performance.recompute_for(name) for name in plan.parallelism},
                   frozen=frozenset(name for name in plan.parallelism if _frozen(name, frozen)),
                   encoder_tokens=config.memory.encoder_tokens(), step_encoders=plan.step_encoders,
                   packed_image_tokens=plan.pack_image_tokens,
                   adapters=adapters, optimizer_precision=config.optimizer.optimizer_precision,
                   still_encoders=still, still_experts=frozenset(
                       name for name in plan.parallelism if _frozen(name, frozen)
                       and not {"experts", "all"} & set((plan.adapter_targets or {}).get(name, ()))))


def _still(module: str, part: str, frozen: tuple[str, ...], adapters: tuple, projection: bool = False) -> bool:
    """An encoder module's `part` (`encoders` or `input_projections`) trains nothing: frozen by a prefix, and no
    LoRA adapter there. Nothing before an encoder's layers needs a gradient, so frozen layers keep nothing."""
    whole = f"modality_submodules.{module}.{part}."
    if not any(whole.startswith(p) for p in frozen):
        return False
    for name, _, _, body, with_projection in (adapters[2] if adapters else ()):
        if name == module and (with_projection if projection else body):
            return False
    return True


def _frozen(module: str, prefixes: tuple[str, ...]) -> bool:
    """The whole module frozen: the LLM under `language_model.`; an encoder only when everything of its
    modality (encoders and projection) is."""
    whole = "language_model." if module == LANGUAGE else f"modality_submodules.{module}."
    return any(whole.startswith(p) for p in prefixes)


def estimate(memory: dict[str, ModuleMemory], parallelism: dict[str, ModuleParallelism], options: Options,
             rows: dict[str, int]) -> list[RankEstimate]:
    """Estimates for every kind of rank. `rows`: samples per micro-batch an encoder rank reads (its lanes or its
    share of one, core.topology.data_positions); the LLM's is the micro-batch size."""
    layout = Layout(parallelism)
    if layout.colocated and not layout.stages_beside_encoders:
        [group] = layout.groups()
        rank = RankEstimate(group.kind, group.ranks)
        for name in group.modules:
            rows_of = rows.get(name)
            if options.step_encoders and name != LANGUAGE:  # one encoder pass over all micro-batches' samples
                rows_of = (rows_of or options.micro_batch_size) * options.num_microbatches
            rank.modules.append(_module(name, memory[name], layout, 0, 1, rows_of, options))
        _one_backward_at_a_time(rank)
        return [rank]
    # the multimodule 1F1B pipeline: the encoders are its first stage, the LLM's stages follow (colocated: the
    # encoders run once per step beside each stage, core/forward/encoders_beside_stages.py)
    stages = 1 + layout.stages(LANGUAGE)
    out = []
    for group in layout.groups():
        rank = RankEstimate(group.kind, group.ranks)
        for name in group.modules:
            if name == LANGUAGE:
                in_flight = min(stages - 1 - group.stage, options.num_microbatches)
                rank.modules.append(_module(name, memory[name], layout, group.stage, in_flight, None, options))
            elif layout.colocated:  # beside the LLM's stages: one encoder pass over the step's shares
                rows_of = (rows.get(name) or options.micro_batch_size) * options.num_microbatches
                rank.modules.append(_module(name, memory[name], layout, 0, 1, rows_of, options))
            else:
                rank.modules.append(_module(name, memory[name], layout, 0, min(stages, options.num_microbatches),
                                            rows.get(name), options))
        if layout.colocated:
            _one_backward_at_a_time(rank)
        out.append(rank)
    return out


def _one_backward_at_a_time(rank: RankEstimate) -> None:
    """Colocated, an encoder's backward runs after the LLM's backward of the micro-batches it fed has freed their
    activations (at the end of the step with the step encoder pass), and encoders' backwards run one after another:
    the largest encoder working set (a recomputed layer) and the LLM's activations are never held at once. The
    rank's activations are the encoders' kept ones plus the larger of the two (measured on an H200, the slice with
    two 4096-patch images a sample: 55.0 GiB peak; the sum of them planned 58.8, this 55.0)."""
    llm = next((m for m in rank.modules if m.module == LANGUAGE), None)
    encoders = [m for m in rank.modules if m.module != LANGUAGE]
    if llm is None or not encoders:
        return
    largest = max(encoders, key=lambda m: m.working)
    for m in encoders:
        m.activations -= m.working
    largest.activations += max(0.0, largest.working - llm.activations)


def _module(name: str, memory: ModuleMemory, layout: Layout, stage: int, in_flight: int,
            rows: int | None, options: Options) -> ModuleTerms:
    stages = layout.stages(name)
    per_stage = len(memory.layers) // stages
    layers = list(memory.layers[stage * per_stage:(stage + 1) * per_stage])
    ends = ([memory.first] if stage == 0 else []) + ([memory.last] if stage == stages - 1 else [])
    weights = sum((layer.weights for layer in layers + ends), Weights())
    tp, expert_shards = layout.weight_shards(name)
    dense = weights.tp / tp + weights.replicated
    experts = weights.expert / expert_shards
    count = dense + experts
    value = 2 if options.bf16 else 4
    trainable = name not in options.frozen
    state_bytes, grad_bytes = optimizer_bytes(options)
    state = state_bytes if trainable else 0
    dense_shards, expert_state_shards = layout.optimizer_shards(name) if options.distributed_optimizer else (1, 1)
    optimizer = state * (dense / dense_shards + experts / expert_state_shards)
    lora = adapter_count(name, memory, options.adapters)
    lora_state = state_bytes
    optimizer += lora_state * lora / dense_shards
    mode = options.recompute.get(name, "none")
    per_sample = tokens_per_sample(name, memory, options.encoder_tokens, options.packed_image_tokens)
    tokens = options.micro_batch_size * per_sample if rows is None else rows * per_sample
    tokens /= layout.sequence_shards(name)  # the LLM's merged sequence is split over its CP ranks
    sp = layout.sequence_parallel_over(name, options.sequence_parallel)

    def per_rank(b: TokenBytes) -> float:
        return tokens * (b.replicated / sp + b.tp / tp + b.expert / sp)

    def stack_copy(layer) -> float:
        # experts whose weights a grouped GEMM takes stacked: where the distributed optimizer's buffer holds them
        # apart, each forward stacks a copy and keeps it for the backward (plugins/kit/expert_storage.py)
        if not (layer.stacked_experts and options.distributed_optimizer):
            return 0.0
        return value * layer.weights.expert / expert_shards

    def kept_by(layer) -> float:
        kept = per_rank(layer.kept(mode, value)) + (0.0 if mode == "full" else stack_copy(layer))
        if name in options.still_experts:  # frozen experts keep no inputs for their weights' gradients
            kept -= per_rank(TokenBytes(expert=layer.wgrad_inputs(mode, value).expert))
        return kept

    def working_of(layer, layer_mode: str) -> float:  # full recompute: the copy of the one layer recomputed
        return per_rank(layer.working(layer_mode, value)) + (stack_copy(layer) if layer_mode == "full" else 0.0)

    still = dict(options.still_encoders)
    if name in still:  # frozen encoders run as in inference: one layer's forward at a time, nothing kept
        body = ([memory.first] if stage == 0 else []) + layers
        kept = 0.0 if still[name] else sum(kept_by(layer) for layer in ends if layer not in body)
        working = max([working_of(layer, "full") for layer in body] or [0.0])
    else:
        kept = sum(kept_by(layer) for layer in layers + ends)
        working = max([working_of(layer, mode) for layer in layers + ends] or [0.0])
    return ModuleTerms(name, stage, len(layers), mode, tokens, in_flight, parameters=value * (count + lora),
                       gradients=grad_bytes * ((count if trainable else 0) + lora), optimizer=optimizer,
                       activations=in_flight * kept + working, parameter_count=count + lora, working=working)


def optimizer_bytes(options: Options) -> tuple[int, int]:
    """(optimizer state, gradient buffer) bytes per trainable parameter. fp32 runs: Adam's two fp32 moments, the
    weights are the main weights. bf16 runs: fp32 main weights and moments (12); --optimizer-precision
    bf16-moments: bf16 moments and the main weights' 16-bit remainders (6); bf16 also halves the gradients."""
    if not options.bf16:
        return 8, 4
    return {"fp32": (12, 4), "bf16-moments": (6, 4), "bf16": (6, 2)}[options.optimizer_precision]


def adapter_count(name: str, memory: ModuleMemory, adapters: tuple) -> float:
    """The module's adapter parameters, at most (core/adapters/size.py), counted whole on each of its ranks."""
    if not adapters:
        return 0.0
    from ..adapters.size import adapter_bound

    rank, layout, modules = adapters
    for module, hidden, experts, body, projection in modules:
        if module == name:
            return adapter_bound(memory, hidden, experts, rank, layout, body, projection)
    return 0.0


def tokens_per_sample(name: str, memory: ModuleMemory, encoder_tokens: str | float,
                      packed_image_tokens: int | None = None) -> float:
    """The tokens per sample (a row) the estimate assumes for module `name`: the LLM's always its sequence; an
    encoder's, in packed rows, its tokens for the row's image budget (--pack-image-tokens), else by --image-patches
    (max: the provider's largest; mean: its average; a number: that)."""
    if name != LANGUAGE and packed_image_tokens and memory.tokens_per_image_token and memory.tokens_per_sample:
        return packed_image_tokens * memory.tokens_per_image_token
    if name == LANGUAGE or encoder_tokens == "max" or not memory.tokens_per_sample:
        return memory.tokens_per_sample
    if encoder_tokens == "mean":
        return memory.tokens_per_sample if memory.mean_tokens_per_sample is None else memory.mean_tokens_per_sample
    return float(encoder_tokens)
