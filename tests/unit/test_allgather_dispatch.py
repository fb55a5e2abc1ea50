"""The all-gather expert dispatch's row selection (plugins/kit/allgather_dispatch.py): the routed (token, local
expert) pairs in expert order then token order, in a buffer of fixed size, found without leaving the device."""

from __future__ import annotations

import torch

from mimo.plugins.kit.allgather_dispatch import rows_per_rank, select_local_rows


def test_rows_are_the_routed_pairs_in_expert_order_and_the_rest_is_masked():
    generator = torch.Generator().manual_seed(0)
    tokens, experts, topk = 37, 3, 2
    local_map = torch.rand(tokens, experts, generator=generator) < 0.45
    local_map[5] = False  # a token routed to no local expert
    local_map[:, 1] = False  # an expert without tokens
    capacity = tokens * min(topk + 1, experts)  # room for every pair
    positions, valid = select_local_rows(local_map, capacity)
    expected = [e * tokens + n for e in range(experts) for n in range(tokens) if local_map[n, e]]
    assert int(valid.sum()) == len(expected) and bool(valid[: len(expected)].all())
    assert positions[: len(expected)].tolist() == expected
    assert positions.shape == valid.shape == (capacity,)
    assert not positions[len(expected):].any()  # the unused rows read token 0 of expert 0, and are masked


def test_a_full_buffer_holds_every_pair_when_all_tokens_pick_local_experts():
    local_map = torch.ones(8, 4, dtype=torch.bool)
    local_map[:, 3] = False  # top-3 of 4 experts, all three local
    positions, valid = select_local_rows(local_map, rows_per_rank(tokens=4, ep=2, topk=3, local_experts=4))
    assert bool(valid.all()) and positions.tolist() == [e * 8 + n for e in range(3) for n in range(8)]


def test_the_memory_plan_counts_the_all_gather_buffer():
    """Nemotron's plan: with expert_dispatch all-gather an EP rank holds EP x tokens x min(top-k, local experts)
    routed rows (the fixed-size buffer) instead of top-k copies of its tokens; EP 1 is unchanged."""
    import dataclasses

    from mimo.providers.nemotron.memory import expert_rows, module_memory
    from mimo.providers.nemotron.settings import NemotronVLMSettings

    s = NemotronVLMSettings(backend="te", num_experts=16, moe_router_topk=6, expert_dispatch="all-gather")
    rows = module_memory(s)["language"].expert_rows
    assert rows(1) == 1.0 and rows(2) == 2.0 and rows(4) == 4 * 4 / 6  # EP 4: 4 local experts, fewer than top-k
    assert expert_rows(dataclasses.replace(s, expert_dispatch="all-to-all"))(4) == 1.0
    assert expert_rows(dataclasses.replace(s, expert_gemm="megatron"))(2) == 1.0  # megatron's experts: all-to-all
