"""A training iteration's time for one layout, from the provider's FLOPs and the calibration (calibration.py).

Each kind of rank is a stage: every rank of a colocated layout runs every module one after the other; a
heterogeneous layout has an encoder stage and one stage per LLM pipeline stage, which megatron-core's multimodule
1F1B schedule overlaps. A stage's work per iteration is a few quantities (`Work`): FLOPs per module kind, bytes
each GPU sends in tensor-parallel collectives, in CP's key/value ring and in the experts' all-to-all, encoder
passes beyond the first, split micro-batches. Its seconds are those quantities times the calibration's rates, so
the fit (fit.py) and the estimate read the same terms.

- colocated: the encoders then the LLM on every rank, then the gradient reduce and the optimizer;
- heterogeneous: with t_s a stage's time per micro-batch and m micro-batches, (m - 1) x max t_s + sum t_s
  (the slower stage sets the pace, the others add their fill and drain), plus the bridge per micro-batch, then
  the slowest rank's gradient reduce and optimizer step;
- the LLM's stages beside colocated encoders: the encoders' one pass of the step on every rank first, then the
  LLM's stages as a pipeline of their own (the same formula), then the reduce and the optimizer.

Where colocated encoders read other samples than the LLM (their own TP, or beside the LLM's stages), their
embeddings change hands on the same ranks: the bytes each GPU sends in that exchange are a term of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mimo.plugins import LANGUAGE, ModuleParallelism

from ..parallel.layout import Layout
from .calibration import Calibration

GRAD_BYTES = 4  # mimo reduces gradients in fp32 (grad_reduce_in_fp32)
ACTIVATION_BYTES = 2  # what tensor-parallel collectives carry (bf16; fp32 runs are not calibrated)
TP_COLLECTIVES_PER_LAYER = 4  # forward: the attention's and the MLP's output; backward: their inputs' gradients
ALL_TO_ALLS_PER_MOE_LAYER = 4  # dispatch and combine, forward and backward
# CP's ring (transformer-engine): each attention layer sends its local keys and values CP - 1 times forward, and
# backward the keys and values again and their gradients. An estimate, not fitted to records (no CP run has been
# timed): priced at the calibration's collective bandwidth and not overlapped with the attention, which it is in part
CP_RING_PASSES = 3


@dataclass(frozen=True)
class ModuleWork:
    """One module as the estimate needs it: forward FLOPs per sample (the provider's `model_flops`) and, from
    `module_memory`, its parameters (whole, unsharded) and tokens per sample."""

    forward_flops: float
    dense_parameters: float  # TP-sharded and replicated weights
    expert_parameters: float  # routed experts
    tokens_per_sample: float
    hidden_size: int
    layers: int
    trainable: bool = True
    routed_copies: float = 0.0  # MoE layers x experts per token: the hidden vectors a token sends to experts
    attention_layers: int = 0  # layers whose keys and values CP's ring exchanges
    kv_values: float = 0.0  # keys and values per token in one attention layer (2 x query groups x head size)


@dataclass(frozen=True)
class StepInputs:
    """A candidate run: its modules, their rank grids and the batch."""

    modules: dict[str, ModuleWork]
    parallelism: dict[str, ModuleParallelism]
    micro_batch_size: int
    num_microbatches: int  # per LLM lane
    recompute: dict  # module -> none | selective | full
    step_encoders: bool  # --encoder-pass step: one encoder pass per step (colocated only)
    distributed_optimizer: bool = False

    @property
    def layout(self) -> Layout:
        return Layout(self.parallelism)

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.layout.lanes

    @property
    def gpus(self) -> int:
        return self.layout.ranks


@dataclass
class Work:
    """What one rank of a stage does per iteration, in the units the calibration prices."""

    encoder_flops: float = 0.0
    language_flops: float = 0.0
    ep_bytes: float = 0.0  # what this GPU sends in the experts' all-to-all
    tp_bytes: float = 0.0
    cp_bytes: float = 0.0  # what this GPU sends in CP's key/value ring
    extra_encoder_passes: int = 0
    split_micro_batches: int = 0  # LLM micro-batches that arrive over the bridge
    exchange_bytes: float = 0.0  # what this GPU sends moving embeddings between layouts of the same ranks

    def seconds(self, cal: Calibration) -> dict[str, float]:
        """Seconds per term, named for what the advisor reports."""
        return {"encoder compute": self.encoder_flops * cal.seconds_per_flop("encoder"),
                "LLM compute": self.language_flops * cal.seconds_per_flop("language"),
                "EP all-to-all": self.ep_bytes / cal.all_to_all_bytes_per_s,
                "TP collectives": self.tp_bytes / cal.collective_bytes_per_s,
                "CP key/value ring": self.cp_bytes / cal.collective_bytes_per_s,
                "encoder passes": self.extra_encoder_passes * cal.encoder_pass_overhead_s,
                "split overhead": self.split_micro_batches * cal.split_stage_overhead_s,
                "embedding exchange": self.exchange_bytes / cal.collective_bytes_per_s}


# what a rank of the LLM's stages beside the encoders does before the stages' pipeline starts
BEFORE_STAGES = ("encoder compute", "encoder passes", "embedding exchange")


@dataclass
class Stage:
    """One kind of rank and its seconds per iteration, by term."""

    name: str
    ranks: tuple[int, int]
    work: Work
    terms: dict[str, float] = field(default_factory=dict)
    reduce_bytes: float = 0.0  # each GPU's share of the data-parallel gradient reduce
    optimizer_parameters: float = 0.0  # the parameters this rank's optimizer steps

    @property
    def busy(self) -> float:
        return sum(self.terms.values())


@dataclass
class StepEstimate:
    inputs: StepInputs
    stages: list[Stage]
    pipeline_s: float  # forward and backward of every micro-batch, stages overlapped
    fill_drain_s: float  # of pipeline_s: what the stages other than the slowest add
    bridge_s: float
    reduce_s: float  # the slowest rank's gradient reduce
    optimizer_s: float

    @property
    def seconds(self) -> float:
        return self.pipeline_s + self.reduce_s + self.optimizer_s

    @property
    def slowest(self) -> Stage:
        return max(self.stages, key=lambda s: s.busy)

    def tokens_per_s_per_gpu(self, tokens_per_sample: float) -> float:
        return self.inputs.global_batch * tokens_per_sample / self.seconds / self.inputs.gpus


def _passes(mode: str) -> int:
    """Forward and backward are three forwards' FLOPs; full recomputation adds one forward. Selective recomputes
    the core attention only, no GEMM: counted as nothing (not measured)."""
    return 4 if mode == "full" else 3


def _tp_bytes(work: ModuleWork, par: ModuleParallelism, samples: float, layers: float) -> float:
    if par.tp == 1:
        return 0.0
    per_collective = 2 * (par.tp - 1) / par.tp * samples * work.tokens_per_sample * work.hidden_size
    return TP_COLLECTIVES_PER_LAYER * layers * per_collective * ACTIVATION_BYTES


def _gradients(work: ModuleWork, par: ModuleParallelism, distributed_optimizer: bool) -> tuple[float, float]:
    """(bytes each GPU sends in the module's gradient all-reduce, parameters its optimizer steps) on one rank of
    one pipeline stage. Dense gradients reduce over DP, the experts' over expert DP."""
    if not work.trainable:
        return 0.0, 0.0
    dense = work.dense_parameters / (par.tp * par.pp)
    experts = work.expert_parameters / (par.ep * par.expt_tp * par.pp)
    sent = GRAD_BYTES * (dense * _ring(par.dp) + experts * _ring(par.expt_dp))
    stepped = dense / par.dp + experts / par.expt_dp if distributed_optimizer else dense + experts
    return sent, stepped


def _ring(n: int) -> float:
    """Bytes each GPU sends per byte reduced by a ring all-reduce over n GPUs."""
    return 2 * (n - 1) / n if n > 1 else 0.0


def _module_work(name: str, inputs: StepInputs, work: Work) -> None:
    """Add module `name`'s share of an iteration on one of its ranks (of one pipeline stage for the LLM)."""
    module, par = inputs.modules[name], inputs.parallelism[name]
    # samples' worth of tokens on one rank (Layout.batch_share: the LLM's sequence split over CP, encoders whole)
    samples = inputs.global_batch / inputs.layout.batch_share(name)
    flops = samples * module.forward_flops * _passes(inputs.recompute.get(name, "none")) / (par.tp * par.pp)
    work.tp_bytes += _tp_bytes(module, par, samples, module.layers / par.pp)
    if name == LANGUAGE:
        work.language_flops += flops
        if par.cp > 1:  # the local sequence's keys and values, split over TP by heads
            local_kv = samples * module.tokens_per_sample * module.kv_values / par.tp * ACTIVATION_BYTES
            work.cp_bytes += CP_RING_PASSES * (par.cp - 1) * module.attention_layers / par.pp * local_kv
        if par.ep > 1:  # balanced routing: (EP - 1) / EP of the routed copies go to other ranks
            tokens = samples * module.tokens_per_sample / par.pp
            work.ep_bytes += (ALL_TO_ALLS_PER_MOE_LAYER * tokens * module.routed_copies * module.hidden_size
                              * ACTIVATION_BYTES * (par.ep - 1) / par.ep)
    else:
        work.encoder_flops += flops


def _exchange_bytes(inputs: StepInputs) -> float:
    """What each GPU sends per iteration moving the encoders' embeddings to the LLM on shared ranks: a ring
    all-gather over n ranks sends (n - 1) / n of what it gathers. Fan-in gathers a lane's rows forward; fan-out
    the lanes' gradients backward; beside the LLM's stages the pipeline group gathers a lane's rows forward and
    sums their gradients backward (an all-reduce, twice that). A sample's rows are priced at the encoder's tokens
    (an upper bound: a pixel shuffle or a merger hands the LLM fewer), each the LLM's hidden size wide."""
    layout, llm = inputs.layout, inputs.layout.llm
    if not layout.encoders_read_own_samples:
        return 0.0
    lane_samples = inputs.global_batch / llm.dp
    width = inputs.modules[LANGUAGE].hidden_size * ACTIVATION_BYTES
    sent = 0.0
    for name in layout.encoders:
        lane_rows = lane_samples * inputs.modules[name].tokens_per_sample * width
        encoder = inputs.parallelism[name]
        if layout.stages_beside_encoders:
            sent += 3 * lane_rows * (llm.pp - 1) / llm.pp
        elif encoder.dp > llm.dp:
            n = encoder.dp // llm.dp
            sent += lane_rows * (n - 1) / n
        else:
            n = llm.dp // encoder.dp
            sent += n * lane_rows * (n - 1) / n
    return sent


def _stage(name: str, ranks: tuple[int, int], modules: list[str], inputs: StepInputs) -> Stage:
    stage = Stage(name, ranks, Work())
    for module in modules:
        _module_work(module, inputs, stage.work)
        sent, stepped = _gradients(inputs.modules[module], inputs.parallelism[module], inputs.distributed_optimizer)
        stage.reduce_bytes += sent
        stage.optimizer_parameters += stepped
    return stage


def estimate(inputs: StepInputs, cal: Calibration) -> StepEstimate:
    """The iteration's seconds for `inputs` under calibration `cal`."""
    layout, m = inputs.layout, inputs.num_microbatches
    colocated = layout.colocated
    stages = []
    for group in layout.groups():
        stage = _stage(group.kind, group.ranks, list(group.modules), inputs)
        if colocated:
            if layout.encoders:
                stage.work.extra_encoder_passes = 0 if inputs.step_encoders else m - 1
            stage.work.exchange_bytes = _exchange_bytes(inputs)
        elif LANGUAGE in group.modules:
            stage.work.split_micro_batches = m
        else:
            stage.work.extra_encoder_passes = m - 1  # the pipeline feeds the encoders one micro-batch at a time
        stages.append(stage)
    for stage in stages:
        stage.terms = {k: v for k, v in stage.work.seconds(cal).items() if v}
    if colocated and not layout.stages_beside_encoders:
        pipeline, fill, bridge = stages[0].busy, 0.0, 0.0
    else:
        before = [sum(s.terms.get(k, 0.0) for k in BEFORE_STAGES) if colocated else 0.0 for s in stages]
        per_micro_batch = [(s.busy - b) / m for s, b in zip(stages, before)]
        slowest = max(per_micro_batch)
        bridge = 0.0 if colocated else m * cal.bridge_s
        fill = sum(per_micro_batch) - slowest
        pipeline = max(before) + m * slowest + fill + bridge
    reduce_s = max(s.reduce_bytes for s in stages) / cal.collective_bytes_per_s
    optimizer_s = max(s.optimizer_parameters for s in stages) * cal.optimizer_s_per_parameter
    return StepEstimate(inputs, stages, pipeline, fill, bridge, reduce_s, optimizer_s)
