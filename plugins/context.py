"""What the loop hands a provider's hooks: the run's parallel layout, precision, process groups and data lane."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .modules import LANGUAGE

if TYPE_CHECKING:  # megatron-core imports in seconds; `mimo --help` and `providers list` don't need it
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig


# TransformerConfig fields the loop decides; a provider sets only its model's shape and numerics.
LOOP_OWNED_FIELDS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "context_parallel_size", "params_dtype", "bf16", "pipeline_dtype",
    "calculate_per_token_loss", "variable_seq_lengths", "use_cpu_initialization", "sequence_parallel",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules", "fp8", "fp8_recipe",
    "cuda_graph_impl", "use_te_rng_tracker",
)


@dataclass(frozen=True)
class ModuleParallelism:
    """One module's rank grid: which global ranks, and how they split into TP x CP x DP x PP (and EP)."""

    first_rank: int
    num_ranks: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    expt_tp: int = 1
    cp: int = 1

    @property
    def dp(self) -> int:
        return self.num_ranks // (self.tp * self.cp * self.pp)

    @property
    def expt_dp(self) -> int:
        return self.num_ranks // (self.expt_tp * self.ep * self.pp)

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.num_ranks)


@dataclass
class BuildContext:
    """Passed to `build_encoders` and `build_language_model`."""

    params_dtype: torch.dtype
    parallelism: dict[str, ModuleParallelism]
    pg_collections: dict[str, ProcessGroupCollection | None]
    # Initialize weights on the CPU (then move them): identical weights on every device and any TP size.
    init_on_cpu: bool = True
    # The loop's performance options (`mimo run --recompute` etc.), applied by `transformer_config`.
    recompute: dict[str, str] = field(default_factory=dict)  # module -> none | selective | full
    sequence_parallel: bool = False  # applies to the language model, when its TP > 1
    fp8: str = "none"  # transformer-engine recipe name for the language model, or none
    cuda_graphs: bool = False  # the language model's layers are captured as CUDA graphs after warm-up
    # --cuda-graph-modules: which parts of the language model's layers to capture (megatron-core's names), or
    # None for the provider's choice (a `cuda_graph_modules` in its shape; else whole layers)
    cuda_graph_modules: tuple[str, ...] | None = None
    # the language model's input is packed (THD, variable-length samples): its shapes change every micro-batch
    llm_input_packed: bool = False
    # --overlap-grad-reduce: megatron-core DDP reduces each gradient bucket as its parameters' hooks report them
    overlap_grad_reduce: bool = False

    def transformer_config(self, module: str, **shape) -> TransformerConfig:
        """A TransformerConfig for `module` with the model's `shape` and the loop's layout and precision."""
        from megatron.core.transformer.transformer_config import TransformerConfig

        clash = sorted(set(shape) & set(LOOP_OWNED_FIELDS))
        if clash:
            raise TypeError(f"transformer_config: {', '.join(clash)} are set by the loop, not the provider")
        par = self.parallelism[module]
        if self.cuda_graph_modules is not None and module == LANGUAGE:  # the user's choice over the provider's
            shape.pop("cuda_graph_modules", None)
        shape.setdefault("moe_token_dispatcher_type", "alltoall")  # the only one variable_seq_lengths allows
        return TransformerConfig(
            tensor_model_parallel_size=par.tp,
            pipeline_model_parallel_size=par.pp,
            expert_model_parallel_size=par.ep,
            expert_tensor_parallel_size=par.expt_tp,
            context_parallel_size=par.cp,
            params_dtype=self.params_dtype,
            bf16=self.params_dtype == torch.bfloat16,
            pipeline_dtype=self.params_dtype,
            calculate_per_token_loss=True,
            variable_seq_lengths=True,
            use_cpu_initialization=self.init_on_cpu,
            **self._performance_fields(module, par, shape),
            **shape,
        )

    def _performance_fields(self, module: str, par: ModuleParallelism, shape: dict) -> dict:
        fields = {"sequence_parallel": self.sequence_parallel and par.tp > 1 and module == LANGUAGE}
        mode = self.recompute.get(module, "none")
        if mode == "full":  # keep each layer's input only; recompute the layer in backward
            fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        elif mode == "selective":  # megatron-core's memory-heavy, compute-light parts
            parts = ["core_attn"]
            # norms and MoE activations: megatron-core's output-discarding recompute, which needs
            # transformer-engine and does not work with delayed FP8 scaling
            if importlib.util.find_spec("transformer_engine") is not None and self.fp8 != "delayed":
                parts.append("layernorm")
                if shape.get("num_moe_experts") and shape.get("moe_grouped_gemm"):
                    parts.append("moe_act")
            fields.update(recompute_granularity="selective", recompute_modules=parts)
        if self.fp8 != "none" and module == LANGUAGE:  # encoders' token counts vary (images), FP8 GEMMs need
            fields.update(fp8="hybrid", fp8_recipe=self.fp8)  # multiples of 16

        if self.cuda_graphs:  # the loop captures the language model's layers (mimo.core.run.cuda_graphs)
            fields.update(use_te_rng_tracker=True)
            if module == LANGUAGE:
                fields.update(cuda_graph_impl="transformer_engine")
                if self.cuda_graph_modules is not None:
                    fields.update(cuda_graph_modules=list(self.cuda_graph_modules))
        return fields

    def pg_collection(self, module: str) -> ProcessGroupCollection | None:
        """The module's process groups, or None on a rank that does not hold the module."""
        return self.pg_collections.get(module)

    def is_first_stage(self, module: str) -> bool:
        """Whether this rank holds `module`'s first pipeline stage (its embedding): a model's `pre_process`."""
        pgc = self.pg_collections.get(module)
        return pgc is None or pgc.pp.rank() == 0

    def is_last_stage(self, module: str) -> bool:
        """Whether this rank holds `module`'s last pipeline stage (output layer and loss): `post_process`."""
        pgc = self.pg_collections.get(module)
        return pgc is None or pgc.pp.rank() == pgc.pp.size() - 1


@dataclass(frozen=True)
class DataContext:
    """Passed to `data_provider`: which samples this rank reads.

    `data_provider` returns a `mimo.plugins.DataSource` (or a plain iterator, which the loop wraps as one): its
    optional capabilities (resumable state saved per lane in checkpoints, data counts, skip records, ...) are
    declared and documented there.

    With `--data`, `data_path` is set and the provider reads that dataset, or refuses it with a
    `mimo.errors.UsageError`; it never falls back to other data. `energon_loader(task_encoder)` reads it through
    the loop's machinery (see `mimo.plugins.data`).

    A global batch is `num_lanes * num_microbatches * micro_batch_size` consecutive samples of one stream; LLM
    data-parallel lane `l` takes the l-th contiguous share, one micro-batch at a time. Laid side by side, the
    lanes' m-th micro-batches form `num_lanes * micro_batch_size` positions; this rank reads positions
    `[first_position, first_position + num_positions)` of each: one lane on an LLM rank, several lanes on an
    encoder rank that feeds several LLM lanes, part of a lane on one of several encoder ranks feeding one lane.
    The global batch's content is therefore the same for any layout.
    """

    micro_batch_size: int  # per LLM lane
    num_microbatches: int
    num_lanes: int
    seed: int
    first_position: int = 0
    num_positions: int | None = None  # default: one lane's micro-batch
    start_sample: int = 0  # samples consumed before this run (a resumed run starts past them)
    data_path: str | None = None
    num_workers: int = 0
    pack_sequences: bool = False  # the run's --pack-sequences: pass it to a task encoder whose model takes THD
    # samples read ahead per lane to choose packs from (energon_loader applies it; None: four rows' worth)
    packing_buffer_size: int | None = None
    # image placeholders one packed row may carry (energon_loader gives it to the task encoder; None: no bound)
    pack_image_tokens: int | None = None
    # micro-batches energon_loader's loader makes ahead in a thread (training's --prefetch-microbatches; 0: none),
    # pinned for asynchronous copies to the GPU (`pin_memory`, on GPUs)
    read_ahead: int = 0
    pin_memory: bool = False
    # packed segments' padded lengths a multiple of this: the LLM's context-parallel split (2 x CP, x TP under
    # sequence parallelism; 1 without CP); pass it to a packing task encoder (`segment_multiple`)
    segment_multiple: int = 1
    # which split of the dataset: "train", or "val"/"test" for held-out evaluation (energon_loader applies it;
    # synthetic data tells evaluation apart by its `seed`, which the loop sets to a fixed one of its own)
    split: str = "train"
    # the loaders energon_loader opened: with data_path set, the loop refuses a provider that opened none
    opened_loaders: list = field(default_factory=list, repr=False, compare=False)
    # `(tokens, image_patches) -> forward FLOPs` of one sample, all modules (the provider's `sample_flops`), or
    # None: energon_loader's counts then hold no FLOPs. The loop sets it; a DataSource of its own may call it too
    sample_flops: Callable[[int, list[int]], float | None] | None = field(default=None, repr=False, compare=False)

    @property
    def global_batch_size(self) -> int:
        return self.num_lanes * self.num_microbatches * self.micro_batch_size

    @property
    def rows(self) -> int:
        """Samples (sequences) this rank reads per micro-batch, of all its lanes or its share of one."""
        return self.num_positions or self.micro_batch_size

    @property
    def lane(self) -> int:
        """The (first) LLM lane this rank reads."""
        return self.first_position // self.micro_batch_size

    @property
    def lanes(self) -> range:
        """The LLM lanes this rank reads samples of (several on an encoder rank feeding several lanes)."""
        count = self.rows
        return range(self.lane, self.lane + max(count // self.micro_batch_size, 1))

    @property
    def lane_part(self) -> tuple[int, int]:
        """(part, parts): which share of each of its lane's micro-batches this rank reads; (0, 1) for all."""
        count = self.rows
        if count >= self.micro_batch_size:
            return 0, 1
        return (self.first_position % self.micro_batch_size) // count, self.micro_batch_size // count

    def energon_loader(self, task_encoder, **dataset_kwargs):
        """An iterator of this rank's micro-batches of the energon dataset at `data_path`, encoded and batched by
        `task_encoder`: lanes, worker routing, resumable state and skip counts are the loop's (`LaneLoader`).
        `dataset_kwargs` go to energon's `get_train_dataset` (e.g. `shuffle_buffer_size`). A task encoder built
        with `pack_sequences=True` gets the run's packing buffer."""
        if self.data_path is None:
            raise ValueError("energon_loader needs a DataContext with data_path (the run's --data)")
        from mimo.data import LaneLoader  # energon and torch: only for a run that reads a dataset

        if getattr(task_encoder, "pack_sequences", False):
            dataset_kwargs.setdefault("packing_buffer_size", self.packing_buffer_size
                                      or packing_buffer_for(task_encoder.seq_length))
            task_encoder.image_token_budget = self.pack_image_tokens
        if self.split != "train":
            dataset_kwargs["split_part"] = self.split
        loader = LaneLoader.from_context(self, task_encoder, **dataset_kwargs)
        self.opened_loaders.append(loader)
        return loader

    def sample_indices(self):
        """Yield, forever, the global sample indices of each micro-batch this rank reads, in order."""
        count = self.rows
        share = self.num_microbatches * self.micro_batch_size
        start = self.start_sample
        while True:
            for m in range(self.num_microbatches):
                yield [start + (p // self.micro_batch_size) * share + m * self.micro_batch_size
                       + p % self.micro_batch_size
                       for p in range(self.first_position, self.first_position + count)]
            start += self.global_batch_size


def packing_buffer_for(seq_length: int) -> int:
    """The default packing buffer: four rows of `seq_length` at 128 tokens a sample, at least 64. energon packs each
    buffer on its own, so its last row is the one left partly empty: the more rows a buffer fills, the fuller the
    rows (a 64-sample buffer filled 59% of 8192-token rows of ~150-token samples)."""
    return max(64, -(-4 * seq_length // 128))
