"""Expert parallelism by all-gather and reduce-scatter, the token counts on the device: no host synchronization.

megatron-core's all-to-all dispatcher needs each rank's token counts on the host before its all-to-all (the splits
are Python integers), so every MoE layer waits for the GPU once per micro-batch, and each routed token crosses
the link on its way out and back: with top-k 6 and EP 2, about 3 of every token's hidden vectors leave the rank
in dispatch and as many return in combine. Here instead:

* dispatch: the EP ranks all-gather their tokens' hidden states, routing probabilities and routing maps (every rank
  holds the same number of tokens: mimo's rows are `seq_length` wide, packed or not), so each token's hidden state
  crosses once; each rank then picks the rows its own experts take, in expert order, into a buffer of fixed size
  (every gathered token times min(top-k, local experts): the most its experts can be sent). The rows past the
  routed ones read token 0 and are masked out; the grouped GEMMs stop at the last routed row (their offsets are
  the device-side counts).
* combine: each rank sums its experts' outputs per gathered token (fp32), and one reduce-scatter in the run's
  precision adds the EP ranks' partial sums and hands every rank its own tokens back.

Gradients flow through the same collectives reversed. The shared expert keeps its overlap on a side stream at the same points as in megatron-core's
all-to-all dispatcher. The buffer costs activation memory: EP x tokens x min(top-k, local experts) rows instead of
the tokens x top-k an EP-1 rank holds (the memory plan counts it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty(x.shape[0] * group.size(), *x.shape[1:])
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _scatter_sum(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty(x.shape[0] // group.size(), *x.shape[1:])
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class _Gather(torch.autograd.Function):
    """All-gather along the first dimension; backward: the gradients' reduce-scatter. (megatron-core's
    sequence-parallel mappings allocate on the current CUDA device, which a CPU run's backward does not redirect.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_sum(grad, ctx.group), None


class _ScatterSum(torch.autograd.Function):
    """Reduce-scatter (sum) along the first dimension; backward: the gradients' all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _scatter_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


def applies(dispatcher, config) -> bool:
    """Whether `dispatcher` (megatron-core's all-to-all one) can become the all-gather one: expert parallelism
    without tensor parallelism, dropless, no FP8 padding of the routing map."""
    return (type(dispatcher) is MoEAlltoAllTokenDispatcher and dispatcher.ep_size > 1 and dispatcher.tp_size == 1
            and not dispatcher.drop_and_pad and config.moe_expert_capacity_factor is None
            and not config.moe_router_padding_for_quantization)


def rows_per_rank(tokens: int, ep: int, topk: int, local_experts: int) -> int:
    """Rows of the routed experts' input on one rank for `tokens` tokens a rank (the memory plan's count)."""
    return tokens * ep * min(topk, local_experts)


def select_local_rows(local_map: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`local_map` [N, E] bool (token n routed to local expert e) -> (flat [capacity] positions e * N + n of the
    routed pairs in expert order then token order, padded with 0; valid [capacity] bool), without leaving the GPU."""
    flat = local_map.t().reshape(-1)
    slot = torch.cumsum(flat, 0) - 1
    slot = torch.where(flat, slot, capacity)  # the pairs not routed write past the end, then are cut
    positions = torch.zeros(capacity + 1, dtype=torch.long, device=local_map.device)
    positions.scatter_(0, slot, torch.arange(flat.numel(), device=local_map.device))
    valid = torch.arange(capacity, device=local_map.device) < flat.sum()
    return positions[:capacity], valid


class AllGatherDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron-core's all-to-all dispatcher object turned into the all-gather one above (its class narrowed by
    DeviceCountsMoELayer; it keeps the parent's shared-expert hooks and process groups)."""

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states)
        return hidden_states.view(-1, self.hidden_shape[-1]), probs

    def token_dispatch(self, hidden_states, probs):
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        gathered = _Gather.apply(hidden_states, self.ep_group)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(gathered)
        with torch.no_grad():  # as bytes: not every backend gathers booleans
            self.routing_map = _gather(self.routing_map.to(torch.uint8), self.ep_group).bool()
        return gathered, _Gather.apply(probs, self.ep_group)

    def dispatch_postprocess(self, hidden_states, probs):
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        local_map = self.routing_map[:, first:last]
        tokens = local_map.shape[0]
        capacity = tokens * min(self.config.moe_router_topk, self.num_local_experts)
        positions, self.valid = select_local_rows(local_map, capacity)
        self.token_of_row = positions % tokens
        self.routing_map = None
        rows = torch.where(self.valid.unsqueeze(-1), hidden_states.index_select(0, self.token_of_row), 0)
        row_probs = torch.where(self.valid, probs[:, first:last].t().reshape(-1).index_select(0, positions), 0)
        return rows, local_map.sum(0), row_probs

    def combine_preprocess(self, hidden_states):
        rows = torch.where(self.valid.unsqueeze(-1), hidden_states, 0).float()
        summed = rows.new_zeros(self.hidden_shape[:-1].numel() * self.ep_size, rows.shape[-1])
        summed = summed.index_add(0, self.token_of_row, rows)
        self.valid = self.token_of_row = None
        return summed.to(hidden_states.dtype)

    def token_combine(self, hidden_states):
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        mine = _ScatterSum.apply(hidden_states, self.ep_group)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(mine)
            self.shared_experts.post_forward_comm()
        return mine

    def combine_postprocess(self, hidden_states):
        output = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output
