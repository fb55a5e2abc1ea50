"""MoE layers for one decode token without a host sync.

megatron-core's token dispatchers learn how many tokens each expert gets on the host (the allgather dispatcher's
`tokens_per_expert.cpu()` and `masked_select`, token_dispatcher.py), which stalls every MoE layer of every decode
step until the GPU has caught up; the experts' modules then loop over every expert on the host. For a single token
neither is needed: the router's choice stays on the device as k indices, and the k chosen experts' weights are
gathered from a copy of the layer's expert weights stacked once per decoder ([E, out, in]), so the layer
is a handful of kernels whatever the number of experts. The math is the experts' own: fc1, activation, times the
router's probability (cast back to the weights' dtype, as megatron's experts do), fc2, and the sum over the chosen
experts in fp32 and in expert order, as TE's fused unpermute adds them.

The stacked copy costs the experts' memory once more while decoding (for nemotron-moe-vlm-mid about 1 GB);
layers with many experts per chosen one (e.g. 128 experts top 6: tens of GB at the released LLM's width) keep
megatron's path.
"""

from __future__ import annotations

import torch

from mimo.plugins.kit.grouped_mm_moe import expert_weights

from .patched_forward import patched_forward


# The stacked copy of the experts is worth its memory up to this many experts per chosen one.
MAX_EXPERTS_PER_CHOICE = 8


def eligible(moe) -> bool:
    """Layers whose routed experts are all local and whole: no expert or tensor parallelism, no latent projection,
    no FP8/FP4 padding of expert inputs, probabilities applied after the activation, no adapters."""
    from megatron.core import utils

    config = moe.config
    groups = [getattr(moe, "ep_group", None), getattr(moe, "tp_group", None),
              getattr(moe.token_dispatcher, "tp_group", None)]
    return (all(g is None or utils.get_pg_size(g) == 1 for g in groups)
            and moe.num_local_experts == config.num_moe_experts
            and not config.moe_latent_size and not config.fp8 and not config.fp4
            and not config.moe_apply_probs_on_input and config.moe_expert_capacity_factor is None
            and not hasattr(moe, "_inference_token_dispatcher")
            and config.num_moe_experts <= MAX_EXPERTS_PER_CHOICE * config.moe_router_topk
            and config.moe_mlp_glu_interleave_size is None and not _has_bias(moe.experts)
            and not _has_adapters(moe.experts))


def stacked_expert_weights(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """([E, ffn, H] fc1, [E, H, ffn] fc2) weights of the local experts: TEGroupedMLP's weight0..weightN or
    SequentialMLP's modules."""
    fc1, fc2 = expert_weights(experts)
    return torch.stack([w.detach() for w in fc1]), torch.stack([w.detach() for w in fc2])


def _has_adapters(experts) -> bool:
    """LoRA adapters on the experts (core/adapters): the stacked base weights would leave them out."""
    return any(part == "lora" or part.startswith("lora_") for name, _ in experts.named_parameters()
               for part in name.split("."))


def _has_bias(experts) -> bool:
    modules = ([m for e in experts.local_experts for m in (e.linear_fc1, e.linear_fc2)]
               if hasattr(experts, "local_experts") else [experts.linear_fc1, experts.linear_fc2])
    return any(name.startswith("bias") and p is not None and p.numel() for m in modules
               for name, p in m.named_parameters(recurse=False))


def one_token_forward(moe, megatron_forward):
    """MoELayer.forward for [1, 1, H] inputs (others go to megatron's forward)."""
    fc1, fc2 = stacked_expert_weights(moe.experts)
    config, k = moe.config, moe.config.moe_router_topk
    activation = config.activation_func

    def forward(hidden_states, intermediate_tensors=None, padding_mask=None):
        if intermediate_tensors is not None or padding_mask is not None or hidden_states.shape[:2] != (1, 1):
            return megatron_forward(hidden_states, intermediate_tensors, padding_mask)
        shared = moe.shared_experts(hidden_states) if moe.use_shared_expert else None
        probs, routing_map = moe.router(hidden_states)  # [1, E]: probabilities, and which experts are chosen
        chosen = routing_map[0].to(torch.int8).topk(k).indices.sort().values  # expert order, on the device
        x = hidden_states.reshape(-1, 1)
        h = torch.matmul(fc1[chosen], x).squeeze(-1)  # [k, ffn]
        if config.gated_linear_unit:
            gate, linear = h.chunk(2, dim=-1)
            h = activation(gate) * linear
        else:
            h = activation(h)
        h = (h * probs[0, chosen].unsqueeze(-1)).to(hidden_states.dtype)
        routed = torch.matmul(fc2[chosen], h.unsqueeze(-1)).squeeze(-1)  # [k, H]
        output = routed.sum(0, dtype=torch.float32).to(hidden_states.dtype).view_as(hidden_states)
        return (output if shared is None else output + shared), None

    return forward


class OneTokenMoE:
    """The eligible MoE layers of a model, their experts' weights stacked once: the weights must not change while
    this object lives (a Decoder holds one per set of weights). `with active():` the layers take the one-token
    path."""

    def __init__(self, model):
        from megatron.core.transformer.moe.moe_layer import MoELayer

        layers = [module for module in model.modules() if isinstance(module, MoELayer)]
        self.layers = [(module, one_token_forward(module, module.forward)) for module in layers
                       if eligible(module) and "forward" not in vars(module)]
        self.complete = len(self.layers) == len(layers)  # no layer left on megatron's path (a host sync each)

    def active(self):
        return patched_forward(self.layers)
