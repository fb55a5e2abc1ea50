"""The LLM in pipeline stages while the encoders run on every rank (`--llm-pp` with the modules colocated).

megatron-core 0.19.2 has no such layout: its MimoModel runs modules that share ranks whole (its colocated bridge
refuses PP > 1), and its multimodule pipeline puts each rank in one module's stage. So the encoders leave the
pipeline: as with `--encoder-pass step` (encoder_pass.py), every rank runs its encoders once per step, on its share
of each micro-batch of its lane (topology.data_positions: the ranks of a lane's stages, its pipeline group, read
one share each), before megatron-core's 1F1B schedule runs the LLM's stages. Per micro-batch:

1. the pipeline group gathers its shares' text into the lane's rows (every stage needs them: stage 0 merges the
   embeddings into them, the last stage reads the labels) and its shares' embeddings in share order, which stage 0
   merges as the heterogeneous layout's bridge would have delivered them;
2. after the schedule, stage 0's gradient of those embeddings is summed over the group (the other stages add
   zeros) and each rank keeps its share's rows, which the encoders' one backward then takes.

Values and gradients are those of one process up to the order of floating-point sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mimo.plugins import LANGUAGE

from ..parallel.shared_ranks import gather_rows
from .encoder_pass import EncodedBatch, StepEncoderPass
from .shared_rank_batches import gather_lane, placeholders_of


class EncodersBesideStages:
    """The step's encoder pass for the LLM's stages beside the encoders (the module's docstring): `forward` hands
    the schedule each micro-batch's lane rows with stage 0's embeddings, `backward` runs the encoders' backward."""

    def __init__(self, encoder_pass: StepEncoderPass, model, pp_group):
        self.encoder_pass, self.group = encoder_pass, pp_group
        self.parts, self.slot, self.first_stage = pp_group.size(), pp_group.rank(), pp_group.rank() == 0
        self.special_token_ids, self.hidden_size = model.special_token_ids, model.config.hidden_size
        self.dtype, self.device = encoder_pass.params_dtype, encoder_pass.device
        self._pending: list[tuple[dict, dict, dict]] = []

    def forward(self, batches: list[dict]) -> list[EncodedBatch]:
        self._pending.clear()
        out = []
        for encoded in self.encoder_pass.forward(batches):
            lane, shares = gather_lane(encoded.batch, self.group, self.parts)
            lane.pop("modality_inputs", None)
            rows = {m: counts for m, counts in placeholders_of(self.special_token_ids, shares).items() if sum(counts)}
            gathered = {}
            for modality, counts in rows.items():
                own = encoded.embeddings.get(modality)
                own = own.detach().to(self.dtype) if own is not None else \
                    torch.empty((0, self.hidden_size), dtype=self.dtype, device=self.device)
                gathered[modality] = gather_rows(own, counts, self.group).requires_grad_(torch.is_grad_enabled())
            self._pending.append((encoded.embeddings, gathered, rows))
            out.append(EncodedBatch(lane, gathered))
        return out

    def backward(self) -> None:
        """Each rank's share of stage 0's gradients, summed over the pipeline group; then the encoders' backward."""
        for copies, gathered, rows in self._pending:
            for modality, embeddings in gathered.items():
                grad = embeddings.grad if self.first_stage and embeddings.grad is not None else \
                    torch.zeros_like(embeddings)
                dist.all_reduce(grad, group=self.group)  # every rank of the group, for every gathered modality
                copy = copies.get(modality)
                if copy is not None and copy.requires_grad:
                    start = sum(rows[modality][:self.slot])
                    copy.grad = grad[start: start + rows[modality][self.slot]].to(copy.dtype)
        self._pending.clear()
        self.encoder_pass.backward()


def for_step(model, topology, encoder_pass: StepEncoderPass | None) -> EncodersBesideStages | StepEncoderPass | None:
    """The step's encoder pass: beside the LLM's stages where the model runs them so, else `encoder_pass`."""
    if not getattr(model, "stages_beside_encoders", False):
        return encoder_pass
    return EncodersBesideStages(encoder_pass, model, topology.pg_collections[LANGUAGE].pp)
