"""Everything decided about a run before any process exists: the options checked, the provider and its settings
built, the layout validated. Workers only execute a Plan; every rank derives the same one from the same options."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mimo.errors import UsageError
from mimo.plugins import LANGUAGE, BuildContext, ModuleParallelism, Provider, Registry
from mimo.plugins.settings import build_settings

from .. import run_file
from ..adapters import targets as adapter_targets
from ..checkpoint.hf import hf_base_settings  # the settings of --pretrained's folders
from ..config import DEFAULT_TRAIN_ITERS, RunConfig
from ..forward import encoder_pass
from ..memory import fit, pack_budget
from ..parallel import optim
from ..parallel.layout import Layout
from ..parallel.provider_refusal import provider_refusal
from . import launch, pack_scan


@dataclass
class Plan:
    """Everything decided about a run before any process exists: validated, so workers only execute it."""

    config: RunConfig
    provider: Provider
    hooks: object
    settings: object
    shapes: dict
    layout: Layout  # each module's grid, checked (core/parallel/layout.py)
    world_size: int
    global_batch_size: int
    num_microbatches: int
    train_iters: int
    step_encoders: bool = False  # --encoder-pass: the encoders run once per step (encoder_pass.py)
    encoders_recomputed: bool = False  # --encoder-pass auto made the encoders' --recompute full for that
    adapter_targets: dict | None = None  # --lora-rank: {module: layer names} (core/adapters/targets.py)
    pack_image_tokens: int | None = None  # packed --data: image placeholders a row may carry (memory/pack_budget.py)
    pack_scan: object = None  # the packs --data makes, where the budget came from them (pack_scan.py)

    @property
    def parallelism(self) -> dict[str, ModuleParallelism]:
        return self.layout.parallelism

    @property
    def num_lanes(self) -> int:
        return self.layout.lanes

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.config.training.precision == "bf16" else torch.float32

    def build_context(self, pg_collections: dict, on_gpu: bool = False) -> BuildContext:
        """What `build_encoders` and `build_language_model` are told: layout, precision, groups (this rank's,
        {} before any exists), performance options, and where the weights are drawn (`on_gpu`: the run's device)."""
        perf, init = self.config.performance, self.config.training.init_device
        return BuildContext(params_dtype=self.params_dtype, parallelism=self.parallelism,
                            pg_collections=pg_collections, init_on_cpu=init == "cpu" or not on_gpu,
                            recompute={name: perf.recompute_for(name) for name in self.parallelism},
                            sequence_parallel=perf.sequence_parallel, fp8=perf.fp8, cuda_graphs=perf.cuda_graphs,
                            cuda_graph_modules=perf.graph_modules(),
                            llm_input_packed=self.config.data.data is not None and self.config.data.pack_sequences,
                            overlap_grad_reduce=perf.overlap_grad_reduce)


def prepare(config: RunConfig, registry: Registry | None = None, world_size: int | None = None,
            planning: bool = False) -> Plan:
    """Check the options, the provider and its settings, and the layout; raise UsageError on the first problem.
    `planning`: for `mimo plan`, whose memory choices are made for GPUs even on a host without one (fit.py)."""
    config.validate()
    registry = registry or Registry()
    provider, _ = registry.get(config.provider)
    hooks = registry.hooks(config.provider)
    if config.provider_config is not None:
        run_file.refuse_loop_options(config.provider_config, provider.settings)
    run_file.refuse_loop_settings(config, provider.settings)  # before "unknown setting" guesses a setting
    settings = build_settings(provider, config.provider_settings, config.provider_config, config.provider_values,
                              config.config_file, base=hf_base_settings(config, provider, hooks))
    shapes = hooks.model_shape(settings=settings)
    t = config.training
    if world_size is None:
        world_size = launch.world_size(config.launch)  # a launcher's world (torchrun, srun), or the options
    layout = Layout.of_run(config, world_size, shapes, getattr(settings, "seq_length", None),
                           tuple(gpu_only_options(config))).check()  # --device cpu: the GPU-only options too
    parallelism = layout.parallelism
    unknown = sorted(set(config.performance.recompute_modes()) - set(shapes) - {"*"})
    if unknown:
        raise UsageError(f"--recompute names module '{unknown[0]}', which provider '{config.provider}' does not "
                         f"have: use {', '.join(sorted(shapes))}")
    lanes = layout.lanes
    per_microbatch = t.micro_batch_size * lanes
    global_batch = t.global_batch_size or per_microbatch * (t.num_microbatches or 1)
    if global_batch % per_microbatch:
        raise UsageError(f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size x LLM "
                         f"data-parallel size = {t.micro_batch_size} x {lanes}")
    train_iters = t.train_iters or (t.train_samples // global_batch if t.train_samples else DEFAULT_TRAIN_ITERS)
    if train_iters < 1:
        raise UsageError(f"--train-samples {t.train_samples} is less than one global batch ({global_batch})")
    optim.check_schedule(config.scheduler, global_batch, train_iters * global_batch)
    _check_chosen_iterations(config.logging, train_iters)
    step = encoder_pass.step_encoders(config.performance.encoder_pass, hooks=hooks, parallelism=parallelism,
                                      device=t.device)
    lora = None
    if config.adapters.enabled:
        modalities = sorted(m for m in shapes if m != LANGUAGE)
        lora = adapter_targets.resolve(config.adapters.lora_targets, hooks.lora_targets(settings=settings),
                                       modalities, config.provider)
    plan = Plan(config, provider, hooks, settings, shapes, layout, world_size, global_batch,
                global_batch // per_microbatch, train_iters, step, adapter_targets=lora)
    if refused := provider_refusal(plan):  # what every worker's build would refuse, before any process starts
        raise UsageError(f"provider '{plan.config.provider}': {refused}")
    fits = functools.partial(fit.fits, planning=planning)
    # the dataset's packs are read only where a memory limit is enforced (a CPU run without one needs no bound)
    scan = pack_scan.scan if fit.gpu_limit_gib(config, planning) is not None else None
    pack_budget.resolve(plan, fits, scan)  # packed rows' images: the dataset's largest pack, at most what fits
    encoder_pass_before = (plan.step_encoders, plan.encoders_recomputed)
    encoder_pass.fit_auto(plan, fits)  # auto: the step's encoder activations must fit the GPU
    if (plan.step_encoders, plan.encoders_recomputed) != encoder_pass_before:
        pack_budget.resolve(plan, fits, scan)  # the encoders keep less now: the budget may grow
    return plan


def gpu_only_options(config: RunConfig) -> list[str]:
    """The options given that need a GPU, as typed."""
    perf = config.performance
    given = [f"--{name}" for name, on in (("fp8", perf.fp8 != "none"), ("cuda-graphs", perf.cuda_graphs), (
        "optimizer-precision", config.optimizer.optimizer_precision != "fp32")) if on]
    if config.training.init_device == "cuda":
        given.append("--init-device cuda")
    if config.logging.memory_snapshot_dir is not None:  # the GPU allocator's history
        given.append("--memory-snapshot-dir")
    return given


def _check_chosen_iterations(logging, train_iters: int) -> None:
    """An iteration the run never reaches would silently profile or count nothing."""
    chosen = [("--flop-check-iteration", logging.flop_check_iteration)]
    if logging.profile_dir:
        chosen.append(("--profile-step-end", logging.profile_step_end))
    for option, iteration in chosen:
        if iteration is not None and iteration > train_iters:
            raise UsageError(f"{option} {iteration} is past the run's last iteration ({train_iters}): choose one "
                             f"the run reaches, or train longer")
