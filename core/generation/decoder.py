"""Incremental decoding of a built MimoModel with megatron-core's static inference context.

The prompt goes through the encoders and MimoModel's own embedding merge once (prefill), then the language model
takes one token at a time with `StaticInferenceContext`: attention layers keep their keys and values there, Mamba
layers their convolution and SSM states, so a new token costs the same however long the answer grows. Decoding
needs megatron-core's `InferenceMode` (Mamba layers decode only then; GPT/Hybrid models then give the last
position's logits alone, gathered over TP).

One conversation at a time (batch 1), every rank in lock-step: each chooses the token from the same gathered
logits and world rank 0's choice is broadcast, so all ranks feed the same token and stop together. Layouts: every
module on every rank (colocated), the LLM in one pipeline stage, no sequence parallelism; TP and EP within them.
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimo.errors import UsageError
from mimo.plugins import LANGUAGE

from ..run.step import to_device
from .one_token_moe import OneTokenMoE

STOP_END, STOP_LENGTH = "end", "length"  # the answer ended with a stop token / reached --max-new-tokens
STOP_CHECK_EVERY = 8  # steps between host checks for a stop token: at most 7 wasted steps, no sync in between


@dataclass
class Generated:
    tokens: list[int]  # the answer's tokens, without the stop token
    stop: str  # STOP_END or STOP_LENGTH
    prefill_seconds: float
    decode_seconds: float  # the steps after the first token
    decode_steps: int  # forward passes after the prefill (with those after a stop token, dropped)

    @property
    def decode_tokens_per_second(self) -> float | None:
        steps, seconds = self.decode_steps, self.decode_seconds
        return steps / seconds if steps > 0 and seconds > 0 else None


def _fresh(value):
    """The encoder inputs with each non-tensor object (a PackedSeqParams) copied: an encoder may move its fields
    (megatron-core's RADIO shifts the boundaries for its class tokens), and a prompt is encoded more than once."""
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return value if isinstance(value, torch.Tensor) or value is None else copy.copy(value)


def check_plan(plan, way_out: str) -> None:
    """One line when the planned layout cannot decode (`way_out` says what to do instead)."""
    parallelism = plan.parallelism
    if len({(p.first_rank, p.num_ranks) for p in parallelism.values()}) != 1:
        raise UsageError(f"generation needs every module on every rank (colocated, --encoder-ranks 0): {way_out}")
    if parallelism[LANGUAGE].pp > 1:
        raise UsageError(f"generation needs the LLM in one pipeline stage (--llm-pp 1): {way_out}")
    if plan.config.performance.sequence_parallel:
        raise UsageError(f"generation does not run with --sequence-parallel: {way_out}")


def unwrapped(module):
    from megatron.core.utils import unwrap_model

    return unwrap_model(module)


@contextmanager
def eval_mode(model):
    """The model in eval mode (megatron's attention reads cached keys without a causal mask only then; no dropout,
    no position jitter), put back as it was."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class Decoder:
    """Answers prompts with a built MimoModel: `generate(prompt, max_new_tokens=..., stop_ids=..., sampler=...)`.
    Called on every rank of the world together (collective). One Decoder per set of weights: the one-token MoE
    path keeps a copy of the experts' weights, made at the first `generate`."""

    def __init__(self, model, *, device: torch.device, params_dtype: torch.dtype, sync_free: bool = True):
        self.model, self.device, self.params_dtype, self.sync_free = model, device, params_dtype, sync_free
        self.lm = unwrapped(model.language_model)  # the DDP wrapper adds nothing without gradients
        self._one_token_moe = None

    def one_token_moe(self) -> OneTokenMoE:
        if self._one_token_moe is None:
            self._one_token_moe = OneTokenMoE(self.lm)
        return self._one_token_moe

    def prompt_embeddings(self, input_ids: torch.Tensor, modality_inputs: dict) -> torch.Tensor:
        """MimoModel's colocated merge (its `_forward_all_modules` up to the language model): [S, 1, H]."""
        model = self.model
        position_ids = torch.arange(input_ids.shape[1], device=self.device)[None]
        embeddings = {}
        for name, submodule in model.modality_submodules.items():
            if modality_inputs.get(name) is not None:
                out = unwrapped(submodule)(encoder_inputs=_fresh(modality_inputs[name]))
                if out is not None:
                    embeddings[name] = out
        if model.colocated_comms:
            embeddings = model._apply_colocated_comms(embeddings)
        embeddings["text"] = model.get_text_embeddings(input_ids, position_ids, model.special_token_ids)
        return model.align_embeddings_by_token_positions(embeddings, input_ids, model.special_token_ids)

    @torch.no_grad()
    def generate(self, prompt, *, max_new_tokens: int, stop_ids: frozenset[int], sampler) -> Generated:
        """Up to `max_new_tokens` tokens after `prompt` (an `EncodedPrompt`), ending at a token of `stop_ids`.

        A step never waits for the GPU: the chosen tokens stay on the device and the host looks for a stop token
        every `STOP_CHECK_EVERY` steps (the steps after a stop are computed and dropped), and MoE layers take the
        one-token path of one_token_moe.py (`sync_free=False`: megatron-core's own MoE path, a host sync per MoE
        layer, and a check for a stop token at every step)."""
        from megatron.core.inference.contexts import StaticInferenceContext
        from megatron.core.inference.utils import InferenceMode

        input_ids = prompt.input_ids.to(self.device)
        length = input_ids.shape[1]
        context = StaticInferenceContext(max_batch_size=1, max_sequence_length=length + max_new_tokens)
        modality_inputs = to_device(prompt.modality_inputs, self.device, self.params_dtype)
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        check_every = STOP_CHECK_EVERY if self.sync_free else 1
        # allocated once: a step's position and token are views and copies, no new tensors
        positions = torch.arange(length + max_new_tokens, device=self.device)[None]
        chosen = torch.empty(max(max_new_tokens, 1), dtype=torch.long, device=self.device)
        stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=self.device) if stop_ids else None
        moe = self.one_token_moe().active() if self.sync_free else nullcontext()
        count, checked = 0, 0
        with eval_mode(self.model), InferenceMode.active(), moe:
            started = time.perf_counter()
            combined = self.prompt_embeddings(input_ids, modality_inputs)
            logits = self.lm(input_ids=None, position_ids=positions[:, :length], decoder_input=combined,
                             attention_mask=None, inference_context=context, runtime_gather_output=True)
            context.increment_sequence_len_offset(length)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            prefilled = time.perf_counter()
            for step in range(max_new_tokens):
                token = sampler.choose(logits[0, -1])  # [1, 1]
                if distributed:
                    dist.broadcast(token, src=0)
                chosen[step:step + 1].copy_(token.view(1))
                count = step + 1
                if count == max_new_tokens:
                    break
                if stops is not None and count - checked >= check_every:
                    # the one host sync, every check_every steps
                    if bool(torch.isin(chosen[checked:count], stops).any()):
                        break
                    checked = count
                offset = context.sequence_len_offset
                logits = self.lm(input_ids=token, position_ids=positions[:, offset:offset + 1], attention_mask=None,
                                 inference_context=context, runtime_gather_output=True)
                context.increment_sequence_len_offset(1)
            tokens = chosen[:count].tolist()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            finished = time.perf_counter()
        end = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
        steps = count - 1  # forward passes after the prefill
        if end is not None:
            return Generated(tokens[:end], STOP_END, prefilled - started, finished - prefilled, steps)
        return Generated(tokens, STOP_LENGTH, prefilled - started, finished - prefilled, steps)
