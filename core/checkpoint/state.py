"""The state a checkpoint keeps beside the model's weights: each module's optimizer state in a form that loads in
any layout, with megatron-core 0.19.2's distributed-optimizer loading worked around, and the RNG states."""

from __future__ import annotations

import random

import numpy as np
import torch

_OWN_COMMON = "module_common"


def own_common(sub: dict, key: str, pgc) -> dict:
    """Move a module's non-sharded optimizer state (param groups, step) into a sharded object of its own.

    megatron-core saves non-sharded state from rank 0 only, which in a heterogeneous layout holds no LLM; its
    MimoOptimizer extracts param groups only from the mixed-precision format, not from the fp32 one."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase, ShardedObject

    if not sub or pgc is None:
        return sub
    # Local objects (param ids) are filled in from the running optimizer at load: leave them to megatron-core.
    sharded, common = extract_matching_values(sub, lambda v: isinstance(v, (ShardedBase, LocalNonpersistentObject)))
    sharded[_OWN_COMMON] = ShardedObject(f"{key}.{_OWN_COMMON}", common, (1,), (0,),
                                         replica_id=(pgc.tp.rank(), pgc.pp.rank(), pgc.dp.rank(), pgc.cp.rank()))
    return sharded


def merge_common(sub: dict) -> dict:
    from megatron.core.dist_checkpointing.dict_utils import merge

    if not sub or _OWN_COMMON not in sub:
        return sub
    common = sub.pop(_OWN_COMMON)
    return merge(sub, common)


def allocate_optimizer_state(mimo_optimizer) -> None:
    """A distributed optimizer describes its checkpoint from its state, which exists only after a step; give a
    fresh one its state tensors (megatron-core's own helper; the loaded values replace them)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for info in mimo_optimizer.module_infos.values():
        inner = getattr(info.optimizer, "chained_optimizers", [info.optimizer])
        for opt in inner:
            if isinstance(opt, DistributedOptimizer):
                if not opt.optimizer.state:
                    opt._init_optimizer_states_with_dummy_values()
                _skip_adam_step_on_load(opt)


def unshare_adam_steps(mimo_optimizer) -> None:
    """megatron-core's distributed optimizer (without Apex or TE) restores torch Adam's `step` as one tensor
    shared by every parameter's state; Adam increments it in place once per parameter. Give each its own."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for info in mimo_optimizer.module_infos.values():
        for opt in getattr(info.optimizer, "chained_optimizers", [info.optimizer]):
            if isinstance(opt, DistributedOptimizer):
                for state in opt.optimizer.state.values():
                    if isinstance(state.get("step"), torch.Tensor):
                        state["step"] = state["step"].clone()


def _skip_adam_step_on_load(opt) -> None:
    """megatron-core 0.19.2 copies every state tensor of a parameter when it loads distributed-optimizer
    state, torch Adam's per-parameter `step` included, though it restores steps from the common state (the
    parameter groups) just before. The fully_reshardable loader hands over no `step` (a KeyError without Apex
    or TE); the dp_reshardable one hands over the running optimizer's own `step`, here the dummy step's 1, which
    would overwrite the restored count. Never copy `step`, whatever the loader hands over."""
    if getattr(opt, "_mimo_skips_step", False):
        return
    original = opt._set_main_param_and_optimizer_states
    opt._set_main_param_and_optimizer_states = lambda param, tensors: original(param, {**tensors, "step": None})
    opt._mimo_skips_step = True


def rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])
