"""Build megatron-core's MimoModel from a provider's hooks, place it on the device and wrap each module in DDP."""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import partial

import torch

from mimo.errors import UsageError
from mimo.plugins import BuildContext, Encoder
from mimo.plugins.kit.te_extras import te_extras_enabled

from ..adapters.apply import add_adapters
from ..config import AdapterOptions
from . import embedding_merge, shared_ranks
from .topology import LANGUAGE, Topology
from .wgrad_fusion import fuse_weight_gradient_accumulation


def _seeded_mimo_model_class():
    """MimoModel that reseeds before building the encoders and before building the LLM, so each module's
    initial weights are the same whichever modules a rank builds (colocated, heterogeneous, any TP)."""
    from megatron.core.models.mimo import MimoModel
    from megatron.core.models.mimo.config.role import ModuleLayout, ModuleStageInfo
    from megatron.core.utils import unwrap_model

    class SeededMimoModel(MimoModel):
        """Also merges text and encoder embeddings without synchronizing when the caller hands over where the
        placeholders are (`placeholder_rows`, embedding_merge.py); without them, megatron-core's merge."""

        init_seed = 0
        # (module names, seed) -> None: reseeds megatron-core's RNG tracker for weights drawn on the GPU, which
        # draws from its streams instead of torch's CPU generator; None when the weights are drawn on the CPU
        seed_tracker = None
        _rows = None
        _embeddings = None
        _exchange = None
        _device = None

        def __init__(self, mimo_config, **kwargs):
            super().__init__(mimo_config, **kwargs)
            # The LLM's pipeline stages on the encoders' ranks: megatron-core sees one grid of ranks (colocated)
            # and would run the LLM whole; each rank runs its stage instead, fed the step's encoder embeddings
            # (core/forward/encoders_beside_stages.py) on stage 0 and the previous stage's hidden states after.
            self.stages_beside_encoders = self.role.mode is ModuleLayout.COLOCATED and _pp(self._llm_grid) > 1
            if self.stages_beside_encoders:
                pp = self._llm_grid.get_pg("pp")
                self.role.modules[LANGUAGE] = ModuleStageInfo(is_first_stage=pp.rank() == 0,
                                                              is_last_stage=pp.rank() == pp.size() - 1)

        @property
        def _llm_grid(self):
            return self.mimo_config.module_to_grid_map[LANGUAGE]

        def _initialize_submodules(self):
            torch.manual_seed(self.init_seed)
            if self.seed_tracker is not None:
                self.seed_tracker(self.mimo_config.modality_submodules_spec, self.init_seed)
            super()._initialize_submodules()

        def _initialize_language_model(self):
            torch.manual_seed(self.init_seed + 1)
            if self.seed_tracker is not None:
                self.seed_tracker((LANGUAGE,), self.init_seed + 1)
            super()._initialize_language_model()

        def _build_colocated_communicators(self):
            # Under the LLM's CP the encoders' grid has DP = LLM DP x CP, so megatron-core would make a fan-in
            # bridge (and it refuses CP > 1 grids). Every colocated rank's encoder reads its LLM lane's samples
            # (topology.data_positions): the whole merged sequence is on each CP rank before the split, and the
            # embeddings pass through as they are. The CP ranks' encoder gradients add up in the encoders' DDP.
            if _cp(self._llm_grid) > 1 or _pp(self._llm_grid) > 1:  # megatron-core's bridge refuses PP > 1 too
                return
            super()._build_colocated_communicators()

        def forward(self, *args, placeholder_rows=None, modality_embeddings=None, exchange_rows=None, **kwargs):
            """`modality_embeddings` {modality: [placeholders, hidden]}: encoder outputs computed already (the
            encoders ran once for the step, core/forward/encoder_pass.py), merged in place of running the encoders;
            they need `placeholder_rows`. `exchange_rows` {modality: rows of each rank of the colocated bridge's
            gather group}: colocated encoders at a TP of their own (shared_ranks.py)."""
            if modality_embeddings is not None and placeholder_rows is None:
                raise ValueError("modality_embeddings need placeholder_rows")
            self._rows, self._embeddings, self._exchange = placeholder_rows, modality_embeddings, exchange_rows
            self._device = kwargs["input_ids"].device if "input_ids" in kwargs else None
            try:
                if self.stages_beside_encoders:
                    return self._forward_stage(*args, **kwargs)
                return super().forward(*args, **kwargs)
            finally:
                self._rows = self._embeddings = self._exchange = None

        def _forward_stage(self, input_ids, position_ids=None, attention_mask=None, loss_mask=None, labels=None,
                           modality_inputs=None, packing_kwargs=None):
            """This rank's stage of the LLM (the encoders ran for the step already): megatron-core's forward of
            an LLM stage, stage 0 merging the embeddings handed over."""
            if self.role.is_first_stage(LANGUAGE):
                if modality_inputs and self._embeddings is None:
                    raise ValueError("the LLM's stages beside the encoders take the step's embeddings, not inputs")
                inputs = dict(self._embeddings or {})
            else:
                inputs = {LANGUAGE: self.input_tensors}
            output, loss_mask = self._forward_language_module(input_ids, position_ids, attention_mask, loss_mask,
                                                              labels, inputs, packing_kwargs)
            return (output[LANGUAGE] if isinstance(output, dict) else output), loss_mask

        def _apply_colocated_comms(self, modality_embeddings):
            if self._exchange is None:  # the same DP on both sides: megatron-core's pass-through
                return super()._apply_colocated_comms(modality_embeddings)
            out = dict(modality_embeddings)
            for modality, rows in self._exchange.items():
                comm = self.colocated_comms.get((modality, LANGUAGE))
                if comm is None or not sum(rows):  # every rank of the group skips it alike
                    continue
                if out.get(modality) is None:  # this rank's samples have none; its group's others do
                    out[modality] = torch.empty((0, self.config.hidden_size), dtype=self.config.params_dtype,
                                                device=self._device, requires_grad=True)
                out[modality] = shared_ranks.exchange(comm, out[modality], rows)
            return out

        def _attach_modality_split_sizes(self, output, input_ids, encoder_name):
            # Fan-in (more encoder than LLM data-parallel ranks): an encoder rank sends its whole output to one
            # LLM rank, so no split is made of it, and megatron-core refuses per-sample sizes there. The
            # gradient coming back is split by the rows each rank sent (core/forward/fan_in.py).
            grids = self.mimo_config.module_to_grid_map
            if grids and encoder_name in grids and _dp(grids[encoder_name]) > _dp(grids[LANGUAGE]):
                return
            super()._attach_modality_split_sizes(output, input_ids, encoder_name)

        def get_text_embeddings(self, input_ids, position_ids, special_token_ids):
            if self._rows is None:
                return super().get_text_embeddings(input_ids, position_ids, special_token_ids)
            embedding = unwrap_model(self.language_model).embedding
            return embedding_merge.embed_every_position(embedding, input_ids, position_ids, special_token_ids)

        def align_embeddings_by_token_positions(self, modality_embeddings, input_ids, special_token_ids):
            if self._rows is None:
                return super().align_embeddings_by_token_positions(modality_embeddings, input_ids,
                                                                   special_token_ids)
            dense = modality_embeddings["text"]  # every position's, from get_text_embeddings above
            if self._embeddings is not None:  # colocated modules share a grid: megatron's bridge passes them through
                modality_embeddings = {**modality_embeddings, **self._embeddings}
            return embedding_merge.merge(dense, modality_embeddings, self._rows)

    return SeededMimoModel


def _dp(grid) -> int:
    return grid.shape[grid.dim_names.index("dp")]


def _cp(grid) -> int:
    return grid.shape[grid.dim_names.index("cp")]


def _pp(grid) -> int:
    return grid.shape[grid.dim_names.index("pp")]


def build_model(performance, *, hooks, settings, provider: str, topology: Topology, context: BuildContext,
                device: torch.device, seed: int, distributed_optimizer: bool = False, trainable: bool = True,
                adapters: AdapterOptions | None = None, adapter_targets: dict | None = None,
                grads_in_fp32: bool = True):
    """The provider's MimoModel for the modules this rank holds: built from its hooks' specs with `context`,
    seeded per module with `seed`, frozen where it says, on `device`, each module wrapped in DDP over its grid
    (with the overlap options of `performance`, a PerformanceOptions, or none); `trainable` False freezes every
    module (no gradient buffers: a model that only converts). With `adapters` enabled, LoRA adapters on the layers
    `adapter_targets` names and every base weight frozen (core/adapters/). `grads_in_fp32` False: gradient buffers
    and their reduction in the run's precision (--optimizer-precision bf16). Collective over the world."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.enums import ModelType
    from megatron.core.models.mimo import MimoModelConfig
    from megatron.core.transformer.spec_utils import ModuleSpec

    try:
        encoders = hooks.build_encoders(settings=settings, ctx=context)
        language = hooks.build_language_model(settings=settings, ctx=context)
    except ValueError as err:  # the provider refuses these settings with these options: its message, one line
        raise UsageError(f"provider '{provider}': {err}") from None
    if not isinstance(encoders, dict) or not all(isinstance(e, Encoder) for e in encoders.values()):
        raise UsageError(f"provider '{provider}': build_encoders must return {{name: mimo.Encoder}}, "
                         f"got {type(encoders).__name__}")
    if not isinstance(language, ModuleSpec):
        raise UsageError(f"provider '{provider}': build_language_model must return a ModuleSpec, "
                         f"got {type(language).__name__}")
    if set(encoders) | {LANGUAGE} != set(topology.parallelism):
        raise UsageError(f"provider '{provider}': build_encoders returned modules {sorted(encoders)} but "
                         f"model_shape declared {sorted(set(topology.parallelism) - {LANGUAGE})}")
    config = MimoModelConfig(
        language_model_spec=language,
        modality_submodules_spec={name: e.spec for name, e in encoders.items()},
        special_token_ids={name: e.placeholder_token_id for name, e in encoders.items()},
        module_to_grid_map=topology.grids,
    )
    model_class = _seeded_mimo_model_class()
    model_class.init_seed = seed
    te_tracker = bool(performance and performance.cuda_graphs)  # as the world seeded it (core/run/world.py)
    model_class.seed_tracker = None if context.init_on_cpu else partial(seed_tracker, topology, te_tracker)
    # With sequence (context) parallelism MimoModel scatters the LLM's combined embeddings over its TP (CP) group
    # itself; given explicitly, since no global parallel_state is set up.
    llm_pgs = topology.pg_collections.get(LANGUAGE)
    tp_group, cp_group = (llm_pgs.tp, llm_pgs.cp) if llm_pgs is not None else (None, None)
    with init_threads(context.init_on_cpu and device.type == "cuda"):
        model = model_class(config, tp_group=tp_group, cp_group=cp_group).to(device)
    if not context.init_on_cpu:  # training's streams as core/run/world.py seeded them, whatever the draws took
        seed_tracker(topology, te_tracker, (LANGUAGE, *topology.pg_collections), seed)
    model.model_type = ModelType.encoder_or_decoder  # megatron-core's schedules read it; MimoModel sets none
    freeze(model, hooks.frozen_parameters(settings=settings), provider, device)
    if adapters is not None and adapters.enabled:
        add_adapters(model, adapters, adapter_targets, seed=seed)
    if not trainable:
        for param in model.parameters():
            param.requires_grad_(False)
    _attach_tp_groups(model, topology)
    overlap_grads = bool(performance and performance.overlap_grad_reduce)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grads_in_fp32, overlap_grad_reduce=overlap_grads,
        use_distributed_optimizer=distributed_optimizer,
        overlap_param_gather=bool(performance and performance.overlap_param_gather),
        # buckets let the reduction of late layers start while early layers still run backward
        bucket_size=40_000_000 if overlap_grads else None)
    for name, module in held_modules(model):
        if context.params_dtype != torch.float32:
            module = module.to(context.params_dtype)  # conv and embedding layers are created in fp32
        wrapped = DistributedDataParallel(_transformer_config(module), ddp_config, module,
                                          pg_collection=topology.pg_collections[name])
        if name == LANGUAGE:
            model.language_model = wrapped
        else:
            model.modality_submodules[name] = wrapped
    if performance is not None and performance.grad_accum_fusion:
        fuse_weight_gradient_accumulation(model, transformer_engine=te_extras_enabled(), hooks_needed=overlap_grads)
    return model


def seed_tracker(topology: Topology, te_tracker: bool, modules, seed: int) -> None:
    """Seed megatron-core's RNG tracker with the TP, EP and expert-TP ranks of the first of `modules` this rank
    holds, so weights drawn on the GPU depend on the seed and those ranks only, not on which other modules the
    rank built before."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    pgs = next((topology.pg_collections[m] for m in modules if topology.pg_collections.get(m) is not None), None)
    if pgs is not None:
        model_parallel_cuda_manual_seed(seed, te_rng_tracker=te_tracker, tp_rank=pgs.tp.rank(),
                                        ep_rank=pgs.ep.rank(), etp_rank=pgs.expt_tp.rank())


@contextmanager
def init_threads(wanted: bool):
    """While the weights are drawn on the CPU for a GPU run, torch's intra-op threads at least this rank's share of
    the node's cores, whatever the environment pins for training (torchrun's OMP_NUM_THREADS=1; mimo's launcher sets
    the share unless OMP_NUM_THREADS is given): the whole model's draws took about 190 s for 7.9 billion parameters
    a rank. torch's CPU random fills give the same values with any number of threads
    (tests/unit/test_init_threads.py). Training's thread count comes back after."""
    before = torch.get_num_threads()
    share = len(os.sched_getaffinity(0)) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if wanted and share > before:
        torch.set_num_threads(share)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def parameters_gathered(model):
    """With --overlap-param-gather the distributed optimizer's updated shards reach the other data-parallel ranks
    only in the next forward: gather them now (a save must hold the updated weights; evaluation must not take the
    next training forward's gather), and gather in forwards again afterwards."""
    model.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        model.enable_forward_pre_hook()


def _attach_tp_groups(model, topology: Topology) -> None:
    """Give every megatron module its module's TP group. Some (CLIPViTModel) keep none, and their
    `sharded_state_dict` would then ask the global parallel_state, which mimo never sets up."""
    from megatron.core.transformer.module import MegatronModule

    for name, module in held_modules(model):
        tp = topology.pg_collections[name].tp
        for sub in module.modules():
            if isinstance(sub, MegatronModule) and getattr(sub, "tp_group", None) is None:
                sub.tp_group = tp


def freeze(model, prefixes: list[str], provider_name: str, device: torch.device) -> None:
    """Stop the parameters under `prefixes` from training. A prefix must match on some rank (world collective):
    in a heterogeneous layout each rank holds only its own modules."""
    import torch.distributed as dist

    matches = torch.zeros(len(prefixes), dtype=torch.int64, device=device)
    for name, param in model.named_parameters():
        for i, prefix in enumerate(prefixes):
            if name.startswith(prefix):
                param.requires_grad_(False)
                matches[i] += 1
    # megatron-core moves a MoE router's expert bias outside the optimizer, from the routing counts, unless told
    # the module is frozen (finalize_model_grads): a frozen LLM must keep it too.
    for name, module in model.named_modules():
        if hasattr(module, "frozen_expert_bias") and f"{name}.".startswith(tuple(prefixes) or ("\0",)):
            module.frozen_expert_bias = True
    if prefixes:
        dist.all_reduce(matches)
    unmatched = [p for p, n in zip(prefixes, matches.tolist()) if n == 0]
    if unmatched:
        raise UsageError(f"provider '{provider_name}': frozen_parameters names '{unmatched[0]}', which matches no "
                         f"parameter (names start with language_model. or modality_submodules.<modality>.)")


def _transformer_config(module):
    """The module's TransformerConfig; a ModalitySubmodules container has none, so take its first encoder's."""
    from megatron.core.transformer.module import MegatronModule

    return next(m.config for m in module.modules() if isinstance(m, MegatronModule))


def held_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of each module this rank holds, the language model last."""
    held = [(name, m) for name, m in model.modality_submodules.items() if m is not None]
    if model.language_model is not None:
        held.append((LANGUAGE, model.language_model))
    return held


def count_parameters(model) -> dict[str, int]:
    """This rank's parameters per module (a TP/PP shard's, not the whole module's)."""
    return {name: sum(p.numel() for p in module.parameters()) for name, module in held_modules(model)}
