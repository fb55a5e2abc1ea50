"""megatron-core's forward/backward schedule for a layout, shared by the training step and evaluation."""

from __future__ import annotations

from functools import partial

from mimo.plugins import LANGUAGE

from ..parallel.topology import Topology
from .cp_bridge import pipeline_communicator
from .fan_in import split_gradients_by_received_rows


def schedule_for(topology: Topology, config):
    """megatron-core's schedule for the layout and its bridge communicator (None when colocated): no pipelining
    when colocated, the LLM's 1F1B when its stages run beside the encoders; the multimodule 1F1B schedule with the
    bridge communicator when the encoders and the LLM have ranks of their own."""
    from megatron.core.pipeline_parallel import schedules

    if topology.colocated and topology.parallelism[LANGUAGE].pp > 1:
        # the LLM's stages beside the encoders, which ran for the step (encoders_beside_stages.py): its own 1F1B
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        pgs = topology.pg_collections[LANGUAGE]
        return partial(schedules.forward_backward_pipelining_without_interleaving,
                       p2p_communicator=P2PCommunicator(pp_group=pgs.pp, config=config), pg_collection=pgs), None
    if topology.colocated:
        return partial(schedules.forward_backward_no_pipelining,
                       pg_collection=topology.pg_collections[LANGUAGE]), None
    from megatron.core.process_groups_config import MultiModuleProcessGroupCollection

    encoders = [name for name in topology.parallelism if name != LANGUAGE]
    communicator = pipeline_communicator(  # megatron-core's, its bridges taking the LLM's CP (cp_bridge.py)
        topology.grids, {**{name: [LANGUAGE] for name in encoders}, LANGUAGE: []}, config,
        dim_mapping={"s": 0, "b": 1, "h": 2},  # MimoModel's LLM activations are [s, b, h]
        module_output_ndim={name: 2 for name in encoders},  # encoder outputs are [tokens, h]
    )
    split_gradients_by_received_rows(communicator)  # fan-in: each encoder rank's rows back to it
    pgs = MultiModuleProcessGroupCollection(
        module_pgs=dict(topology.pg_collections),
        language_model_module_name=LANGUAGE if topology.holds(LANGUAGE) else None,
    )
    return partial(schedules.forward_backward_pipelining_without_interleaving, p2p_communicator=communicator,
                   pg_collection=pgs), communicator
