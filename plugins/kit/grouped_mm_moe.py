"""Routed experts as two grouped GEMMs with the token counts on the GPU: no host synchronization, no per-expert
Python, for MoE layers whose experts all live on the rank (no expert or tensor parallelism).

megatron-core's MoE path on one GPU waits for the GPU once per MoE layer and micro-batch: its token dispatcher
copies the tokens per expert to the host (transformer-engine's grouped GEMM splits its input on the host), and
transformer-engine's `GroupedLinear` then does per-expert work in Python (about 0.5 s of host time per iteration
of a full-width Nemotron slice, its profile in docs/benchmarks.md (g)). Here:

* `grouped_experts` runs fc1, the activation (times the routing probabilities) and fc2 of every expert as
  `torch.nn.functional.grouped_mm` calls whose group boundaries are the cumulative token counts, on the device.
  The activation is the TransformerConfig's, as megatron-core's experts apply it (`expert_activation`): plain
  (Nemotron's squared ReLU) or gated (`gated_linear_unit`: fc1's rows are the gate's then the linear half's, as
  SwiGLU's silu(gate) * up; Qwen3.5's experts).
* the experts' weights lie back to back in one tensor per linear (`expert_storage.py`), which those calls take
  with no copy (stacked where something moved them apart); under mimo's loop their gradients go straight into DDP's
  fp32 `main_grad`s, not through one hook and add per expert: the grouped GEMM's stacked gradient is added in one
  call (`mimo.plugins.kit.main_grad`; on a GPU one Triton kernel, `mimo.plugins.kit.grouped_wgrad`), or, with
  `MIMO_GROUPED_WGRAD=fused`, one Triton grouped GEMM computes and adds them (`_GroupedLinearIntoMainGrad`).
* `GroupedMMExperts` (transformer-engine's `TEGroupedMLP`) and `GroupedMMSequentialMLP` (megatron-core's
  `SequentialMLP`) keep their parent's parameters, initialization and checkpoint keys and replace only the
  forward: a checkpoint moves between them and their parents unchanged.
* `DeviceCountsMoELayer` is megatron-core's `MoELayer` whose all-to-all dispatcher leaves the token counts on the
  device when nothing needs them on the host (one rank of experts, dropless, no FP8 padding) and skips its chunk
  sort by expert, which is the identity with one rank.

`with_grouped_mm_experts(moe_spec)` turns a megatron-core MoE layer spec into this one. Values are those of the
parent modules up to the order of floating-point sums inside the GEMMs (tests/multiprocess/test_grouped_mm_moe.py).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.activations import squared_relu
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from .expert_storage import as_stack, pack_contiguously
from .grouped_wgrad import fused_wgrad_enabled, grouped_wgrad
from .main_grad import adds_into_main_grad, gradient_for_autograd, stacked
from .squared_relu_probs import squared_relu_probs


LOW_PRECISION = "FP8/FP4 (no --fp8)"  # an obstacle adapters work around (core/adapters/te_grouped_linears.py)


class _GroupedLinearIntoMainGrad(torch.autograd.Function):
    """x [T, in] -> [T, out] by each group's weight (`weight` [E, out, in], stacked without autograd); backward
    adds the weight gradients into the `weights`' main_grads with one grouped GEMM (`grouped_wgrad`)."""

    @staticmethod
    def forward(ctx, x, weight, offsets, *weights):
        ctx.save_for_backward(x, weight, offsets)
        ctx.weights = weights
        return F.grouped_mm(x, weight.transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        x, weight, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = F.grouped_mm(grad, weight, offs=offsets) if ctx.needs_input_grad[0] else None
        grouped_wgrad([w.main_grad for w in ctx.weights], grad, x, offsets)
        return (grad_x, None, None, *(gradient_for_autograd(w) for w in ctx.weights))


def _grouped_linear(x: torch.Tensor, weight, offsets: torch.Tensor) -> torch.Tensor:
    """`weight`: a stacked tensor (autograd through it), or the list of weights whose gradients one grouped GEMM
    adds into their main_grads."""
    if isinstance(weight, torch.Tensor):
        return F.grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    return _GroupedLinearIntoMainGrad.apply(x, as_stack(weight), offsets, *weight)


def grouped_experts(hidden: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor, fc1, fc2, activation,
                    recompute=None, adapters=(None, None)) -> torch.Tensor:
    """[tokens, H] sorted by expert -> [tokens, H]: `fc1` [E, ffn, H] (gated: [E, 2 ffn, H]) and `fc2` [E, H, ffn]
    (megatron's [out, in] weights stacked; or each a list of the E weights, whose gradients then go into their
    main_grads from one grouped GEMM), `counts` [E] tokens per expert (any device), `probs` [tokens] routing
    weights applied after the `activation` (of fc1's output: `expert_activation`). `recompute`: a megatron-core
    CheckpointWithoutOutput for the activation (selective recompute).
    `adapters`: for fc1 and fc2, None or `term(x, offsets)`, added to that linear's output as a low-rank adapter
    beside each expert's linear adds it (fc1's before the activation, fc2's to the probs-weighted output)."""
    # the dtype changes on the device: a host tensor converted on the host first would be a new pageable tensor,
    # whose copy makes the host wait for the GPU's queue (megatron-core's all-to-all hands pinned host counts)
    offsets = counts.to(device=hidden.device, non_blocking=True).cumsum(0, dtype=torch.int32)
    up = _grouped_linear(hidden, fc1, offsets)
    if adapters[0] is not None:
        up = up + adapters[0](hidden, offsets).to(up.dtype)

    def act(up, probs):
        if activation is squared_relu:  # one fused kernel each way on a GPU
            return squared_relu_probs(up, probs)
        return (activation(up) * probs.unsqueeze(-1)).to(up.dtype)

    inner = recompute.checkpoint(act, up, probs) if recompute is not None else act(up, probs)
    out = _grouped_linear(inner, fc2, offsets)
    if adapters[1] is not None:
        out = out + adapters[1](inner, offsets).to(out.dtype)
    if recompute is not None:  # on the sum: `inner` is back before either term's backward reads it
        recompute.discard_output_and_register_recompute(out)
    return out


def expert_activation(config):
    """fc1's output -> fc2's input as megatron-core's experts compute it from `config`: `activation_func`, or with
    `gated_linear_unit` activation_func(gate) * (linear + glu_linear_offset) of fc1's two halves (gate rows first),
    each half clamped where `activation_func_clamp_value` says."""
    if not config.gated_linear_unit:
        return config.activation_func
    return functools.partial(gated, config.activation_func, config.glu_linear_offset,
                             config.activation_func_clamp_value)


def gated(activation, offset: float, clamp: float | None, up: torch.Tensor) -> torch.Tensor:
    """A gated linear unit of [rows, 2 ffn] -> [rows, ffn]: megatron-core's `glu` (mlp.py, experts.py)."""
    gate, linear = torch.chunk(up, 2, dim=-1)
    if clamp is not None:
        gate, linear = gate.clamp(min=None, max=clamp), linear.clamp(min=-clamp, max=clamp)
    return activation(gate) * (linear + offset if offset else linear)  # no pass over the rows to add 0


def expert_weights(experts) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The local experts' fc1 ([ffn, H] each; gated [2 ffn, H]) and fc2 ([H, ffn] each) weights, megatron's [out, in]:
    TEGroupedMLP's weight0..weightN or SequentialMLP's modules."""
    if hasattr(experts, "local_experts"):
        local = experts.local_experts
        return [e.linear_fc1.weight for e in local], [e.linear_fc2.weight for e in local]
    n = experts.num_local_experts
    return ([getattr(experts.linear_fc1, f"weight{i}") for i in range(n)],
            [getattr(experts.linear_fc2, f"weight{i}") for i in range(n)])


class _GroupedMMForward:
    """The forward both expert classes share."""

    def grouped_mm_obstacle(self) -> str | None:
        """Why these experts cannot run as grouped GEMMs (what to change), or None."""
        return next(iter(self.grouped_mm_obstacles()), None)

    def grouped_mm_obstacles(self) -> list[str]:
        """Every reason these experts cannot run as grouped GEMMs (what to change), first the one to name."""
        config = self.config
        obstacles = ((self.tp_group.size() > 1, "expert tensor parallelism (--llm-expt-tp 1)"),
                     (config.fp8 or config.fp4, LOW_PRECISION),
                     (config.gated_linear_unit and config.moe_mlp_glu_interleave_size is not None,
                      "interleaved gate and linear rows (moe_mlp_glu_interleave_size)"),
                     (config.add_bias_linear, "biases"),
                     (config.moe_apply_probs_on_input, "routing probabilities on the input"),
                     (getattr(self, "_with_fused_impl", False), "transformer-engine's fused expert ops"),
                     (getattr(self, "offload_expert_fc1", False) or getattr(self, "offload_moe_act", False),
                      "activation offloading"))
        return [what for present, what in obstacles if present]

    def _grouped_mm_eligible(self) -> bool:
        return self.grouped_mm_obstacle() is None

    def adapter_terms(self) -> tuple:
        """Low-rank adapter terms for fc1 and fc2 (`grouped_experts`' `adapters`); mimo's adapters
        (core/adapters/grouped_experts.py) give their experts a subclass with some."""
        return None, None

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs):
        if not self.grouped_mm or args or any(v is not None for v in kwargs.values()):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs)
        fc1, fc2 = expert_weights(self)
        recompute = None
        if getattr(self, "activation_recompute", False):
            recompute = self.activation_checkpoint = tensor_parallel.CheckpointWithoutOutput()
        if not (permuted_local_hidden_states.is_cuda and fused_wgrad_enabled() and adds_into_main_grad(fc1 + fc2)):
            fc1, fc2 = stacked(fc1), stacked(fc2)
        out = grouped_experts(permuted_local_hidden_states, tokens_per_expert, permuted_probs, fc1, fc2,
                              expert_activation(self.config), recompute, self.adapter_terms())
        return out, None

    def _pack_weights(self) -> None:
        """Each of fc1's and fc2's expert weights in one [E, out, in] tensor: the grouped GEMMs take them as they
        lie (expert_storage.py)."""
        if self.grouped_mm:
            for weights in expert_weights(self):
                pack_contiguously(weights)

    def _apply(self, fn, recurse=True):
        # a device or dtype move (weights drawn on the CPU, then moved to the GPU) gives every weight a storage of
        # its own: lay them back to back again, or every forward stacks a copy and keeps it for the backward
        # (1.19 GiB on the slice: measured with `--memory-snapshot-dir`)
        module = super()._apply(fn, recurse)
        if getattr(self, "grouped_mm", False):
            self._pack_weights()
        return module


class GroupedMMExperts(_GroupedMMForward, TEGroupedMLP):
    """transformer-engine's TEGroupedMLP (weight0..weightN of its grouped linears) run as torch grouped GEMMs."""

    def __init__(self, *args, pg_collection=None, **kwargs):
        super().__init__(*args, pg_collection=pg_collection, **kwargs)
        # the expert-data-parallel group, kept as SequentialMLP keeps it (its checkpoint's replica ids): adapters
        # this module holds itself save under SequentialMLP's keys (core/adapters/grouped_experts.py)
        self.dp_group = pg_collection.expt_dp if pg_collection is not None else None
        self.grouped_mm = self._grouped_mm_eligible()
        self._pack_weights()


class GroupedMMSequentialMLP(_GroupedMMForward, SequentialMLP):
    """megatron-core's SequentialMLP (one MLP module per expert) run as torch grouped GEMMs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.grouped_mm = self._grouped_mm_eligible() and self.num_local_experts > 1
        self._pack_weights()


class _DeviceCountsDispatcher(MoEAlltoAllTokenDispatcher):
    """The all-to-all dispatcher on one rank of experts, its token counts left on the device."""

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        return tokens_per_expert  # nothing crosses to the host, nothing waits

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        counts, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, counts, global_probs  # one rank: already sorted by expert

    def combine_preprocess(self, hidden_states):
        return hidden_states


class DeviceCountsMoELayer(MoELayer):
    """MoELayer whose dispatcher keeps the token counts on the device where its experts take them there."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        dispatcher, config = self.token_dispatcher, self.config
        if (type(dispatcher) is MoEAlltoAllTokenDispatcher and getattr(self.experts, "grouped_mm", False)
                and dispatcher.ep_size == 1 and dispatcher.tp_size == 1 and not dispatcher.drop_and_pad
                and config.moe_expert_capacity_factor is None and not config.moe_router_padding_for_quantization):
            # the same object, its class narrowed to a subclass that adds no state
            dispatcher.__class__ = _DeviceCountsDispatcher


_GROUPED = {TEGroupedMLP: GroupedMMExperts, SequentialMLP: GroupedMMSequentialMLP}


def uses_grouped_mm(expert_gemm: str, backend: str) -> bool:
    """A provider's `expert_gemm` setting (auto | grouped_mm | megatron) on `backend` (te | local): auto is these
    experts on te, megatron-core's on local."""
    return expert_gemm == "grouped_mm" or (expert_gemm == "auto" and backend == "te")


def with_grouped_mm_experts(moe_layer_spec):
    """A megatron-core MoE transformer-layer spec (`mlp` a partial of MoELayer) with DeviceCountsMoELayer and the
    grouped-GEMM variant of its experts class; a spec of another shape comes back unchanged."""
    mlp = getattr(getattr(moe_layer_spec, "submodules", None), "mlp", None)
    if not isinstance(mlp, functools.partial) or mlp.func is not MoELayer:
        return moe_layer_spec
    experts = mlp.keywords["submodules"].experts
    grouped = _GROUPED.get(getattr(experts, "func", None))
    if grouped is None:
        return moe_layer_spec
    submodules = dataclasses.replace(mlp.keywords["submodules"], experts=functools.partial(grouped, **experts.keywords))
    layer = functools.partial(DeviceCountsMoELayer, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    return dataclasses.replace(moe_layer_spec, submodules=dataclasses.replace(moe_layer_spec.submodules, mlp=layer))
