"""The LLM's micro-batch on ranks whose colocated encoders run at a TP of their own (`--encoder-tp` other than
`--llm-tp` with the modules on every rank: Layout.shared_ranks_exchange).

Such a rank reads its encoders' samples (topology.data_positions, as an encoder rank of a split layout does): the
encoders' data-parallel layout then holds every sample once. The LLM's rows of the same micro-batch are made here:

- fan-in (encoder DP > LLM DP, e.g. --encoder-tp 1 beside --llm-tp 2): the ranks whose shares make one LLM lane
  (megatron-core's colocated bridge's gather group) exchange their rows' text, and each assembles the lane;
- fan-out (encoder DP < LLM DP, e.g. --encoder-tp 2 beside an LLM at TP 1): the rank read all the lanes its encoder
  replica feeds, and keeps its own lane's rows.

The encoders' inputs stay as read. Each micro-batch goes on with `exchange_rows` {modality: placeholders of each
rank of the group}, which the model's bridge (parallel/shared_ranks.py) moves its embeddings by.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mimo.data.lanes import ROW_KEYS, merge_lane_batches
from mimo.plugins import LANGUAGE

TEXT_KEYS = (*ROW_KEYS, "packing_kwargs")


class SharedRankBatches:
    """Turns a micro-batch as read (the encoders' samples) into the LLM's, for one model's colocated bridge."""

    def __init__(self, comm, special_token_ids: dict[str, int]):
        self.comm, self.special_token_ids = comm, special_token_ids
        rank = dist.get_rank()
        if comm.is_fan_in():
            self.slot = comm.rank_to_src_pos[rank][0] % comm.scale
        else:
            self.slot = comm.rank_to_dest_pos[rank][0] % comm.scale

    @classmethod
    def for_model(cls, model) -> SharedRankBatches | None:
        """The assembly a model's colocated bridges need, or None where the modules share one DP layout."""
        comms = [c for (_, dest), c in getattr(model, "colocated_comms", {}).items() if dest == LANGUAGE]
        moving = [c for c in comms if c.is_fan_in() or c.is_fan_out()]
        if not moving:
            return None
        return cls(moving[0], model.special_token_ids)  # every encoder has the same grid (one --encoder-tp)

    def __call__(self, batch: dict) -> dict:
        return self._fan_in(batch) if self.comm.is_fan_in() else self._fan_out(batch)

    def _fan_in(self, batch: dict) -> dict:
        lane, shares = gather_lane(batch, self.comm.gather_pg, self.comm.scale)
        lane["modality_inputs"] = batch.get("modality_inputs") or {}
        lane["exchange_rows"] = placeholders_of(self.special_token_ids, shares)
        return lane

    def _fan_out(self, batch: dict) -> dict:
        if batch.get("packing_kwargs") is not None:  # Layout.check refuses --pack-sequences here
            raise ValueError("packed rows cannot be cut into lanes")
        input_ids = batch["input_ids"]
        lanes = self.comm.scale
        if input_ids.shape[0] % lanes:
            raise ValueError(f"a micro-batch of {input_ids.shape[0]} rows does not split into {lanes} lanes")
        width = input_ids.shape[0] // lanes
        lane = {k: v for k, v in batch.items() if k not in ROW_KEYS}
        first = self.slot * width
        for key in ROW_KEYS:
            if key in batch:
                lane[key] = batch[key].narrow(-2, first, width).contiguous()
        lane["exchange_rows"] = placeholders_of(self.special_token_ids, list(input_ids.split(width)))
        return lane


def gather_lane(batch: dict, group, parts: int) -> tuple[dict, list[torch.Tensor]]:
    """(the lane's rows, each share's input_ids): the text of `batch` (this rank's share of a lane's micro-batch)
    gathered from the `parts` ranks of `group`, which read the lane's shares in group order; no encoder inputs."""
    text = {k: v for k, v in batch.items() if k != "modality_inputs"}
    unknown = sorted(set(text) - set(TEXT_KEYS))
    if unknown:
        raise TypeError(f"a micro-batch shared between ranks has key {unknown[0]!r}, which has no merge rule (known: "
                        f"{sorted(TEXT_KEYS)})")
    shares = [None] * parts
    # a small exchange of the rows' tokens and masks; the images stay with the rank that encodes them
    dist.all_gather_object(shares, text, group=group)
    return merge_lane_batches(shares), [share["input_ids"] for share in shares]


def placeholders_of(special_token_ids: dict[str, int], parts: list[torch.Tensor]) -> dict[str, list[int]]:
    """{modality: placeholders in each part's input_ids}: the embedding rows each rank of a group holds."""
    return {modality: [int((ids == token).sum()) for ids in parts] for modality, token in special_token_ids.items()}
