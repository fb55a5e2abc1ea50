"""MoE layers for one decode token without a host sync.

megatron-core's token dispatchers learn how many tokens each expert gets on the host (the allgather dispatcher's
`tokens_per_expert.cpu()` and `masked_select`, token_dispatcher.py), which stalls every MoE layer of every decode
step until the GPU has caught up. For a single token the counts need not be known: the token goes to every local
expert once (fixed splits of 1, a CPU tensor) and each expert's output is weighted by the router's dense
probabilities, which are exactly zero for the experts the router did not choose. The experts' own forward does the
math (fc1, activation times probability, fc2), so only the sum over experts differs from the dispatcher's combine,
and adding exact zeros changes nothing: the chosen experts' outputs are added in expert order, as unpermute does.

The GPU reads every local expert's weights instead of top-k of them (for nemotron-moe-vlm-mid, 32 experts of
2 x 1536 x 768 bf16 in 7 layers: about 1 GB a token, well under a millisecond on an H100), which is cheap beside
the host time a decode step otherwise spends waiting. Where that read outweighs the sync (many experts against
top-k, e.g. 128 experts top 6: tens of GB a token at the released LLM's width) megatron's path stays.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


# Every local expert's weights are read per token: worth it up to this many experts per chosen one.
MAX_EXPERTS_PER_CHOICE = 8


def eligible(moe) -> bool:
    """Layers whose routed experts are all local and whole: no expert or tensor parallelism, no latent projection,
    no FP8/FP4 padding of expert inputs, probabilities applied after the activation."""
    from megatron.core import utils

    config = moe.config
    groups = [getattr(moe, "ep_group", None), getattr(moe, "tp_group", None),
              getattr(moe.token_dispatcher, "tp_group", None)]
    return (all(g is None or utils.get_pg_size(g) == 1 for g in groups)
            and moe.num_local_experts == config.num_moe_experts
            and not config.moe_latent_size and not config.fp8 and not config.fp4
            and not config.moe_apply_probs_on_input and config.moe_expert_capacity_factor is None
            and not hasattr(moe, "_inference_token_dispatcher")
            and config.num_moe_experts <= MAX_EXPERTS_PER_CHOICE * config.moe_router_topk)


def one_token_forward(moe, ones: torch.Tensor, megatron_forward):
    """MoELayer.forward for [1, 1, H] inputs (others go to megatron's forward)."""

    def forward(hidden_states, intermediate_tensors=None, padding_mask=None):
        if intermediate_tensors is not None or padding_mask is not None or hidden_states.shape[:2] != (1, 1):
            return megatron_forward(hidden_states, intermediate_tensors, padding_mask)
        shared = moe.shared_experts(hidden_states) if moe.use_shared_expert else None
        probs, _ = moe.router(hidden_states)  # [1, E]: zero off the chosen experts
        tokens = hidden_states.reshape(1, -1).expand(ones.numel(), -1).contiguous()
        routed, bias = moe.experts(tokens, ones, probs.reshape(-1))
        assert bias is None, "routed experts with a bias are not supported"
        output = routed.sum(0, dtype=torch.float32).to(hidden_states.dtype).view_as(hidden_states)
        return (output if shared is None else output + shared), None

    return forward


@contextmanager
def one_token_moe(model):
    """Within: every eligible MoELayer of `model` runs one-token inputs without a host sync."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    patched = []
    for module in model.modules():
        if isinstance(module, MoELayer) and eligible(module) and "forward" not in vars(module):
            ones = torch.ones(module.num_local_experts, dtype=torch.long)  # on the host: no copy back
            module.forward = one_token_forward(module, ones, module.forward)
            patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward
