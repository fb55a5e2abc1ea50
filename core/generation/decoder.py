"""Incremental decoding of a built MimoModel with megatron-core's static inference context.

The prompt goes through the encoders and MimoModel's own embedding merge once (prefill), then the language model
takes one token at a time with `StaticInferenceContext`: attention layers keep their keys and values there, Mamba
layers their convolution and SSM states, so a new token costs the same however long the answer grows. Decoding
needs megatron-core's `InferenceMode` (Mamba layers decode only then; GPT/Hybrid models then give the last
position's logits alone, gathered over TP).

How a step after the prompt runs (`steps`, STEPS): `waiting`, megatron-core's layers as they are (its MoE
dispatcher copies each layer's token counts to the host, and the host checks for a stop token at every step);
`sync-free`, MoE layers on the one-token path (one_token_moe.py) and a stop check every few steps; `device`, also
attention with the token's position on the device (one_token_attention.py), so that no step depends on a host
integer; `graph`, that step captured once as a CUDA graph and replayed (graphed_step.py). `auto`: `graph` on a GPU
in a world of one process where every MoE and attention layer has its one-token path, else `sync-free`. All
compute the same step (in fp32 the same tokens; in bf16 up to rounding). The inference context (the KV cache and
Mamba states) is kept from call to call while the answers fit, so a graph is captured once per decoder.

One conversation at a time (batch 1), every rank in lock-step: each chooses the token from the same gathered
logits and world rank 0's choice is broadcast, so all ranks feed the same token and stop together. Layouts: every
module on every rank (colocated), the LLM in one pipeline stage, no sequence parallelism; TP and EP within them.
"""

from __future__ import annotations

import copy
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimo.errors import UsageError

from ..forward.batch_transfer import to_device
from .graphed_step import capture
from .one_token_attention import OneTokenAttention
from .one_token_moe import OneTokenMoE

STOP_END, STOP_LENGTH = "end", "length"  # the answer ended with a stop token / reached --max-new-tokens
STOP_CHECK_EVERY = 8  # steps between host checks for a stop token: at most 7 wasted steps, no sync in between
WAITING, SYNC_FREE, DEVICE, GRAPH, AUTO = "waiting", "sync-free", "device", "graph", "auto"
STEPS = (AUTO, GRAPH, DEVICE, SYNC_FREE, WAITING)
CACHE_ROOM = 256  # the cache's length is rounded up to a multiple of this, so that it serves the next answers too


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
    if refused := plan.layout.generation_refusal():
        raise UsageError(f"{refused}: {way_out}")
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
    path keeps a copy of the experts' weights, and a graphed step the cache it was captured with."""

    def __init__(self, model, *, device: torch.device, params_dtype: torch.dtype, steps: str = AUTO):
        if steps not in STEPS:
            raise UsageError(f"decoding steps {steps!r}: choose one of {', '.join(STEPS)}")
        self.model, self.device, self.params_dtype, self.requested = model, device, params_dtype, steps
        self.lm = unwrapped(model.language_model)  # the DDP wrapper adds nothing without gradients
        self._one_token_moe = self._attention = self._context = self._graph = None
        self._token = torch.zeros(1, 1, dtype=torch.long, device=device)  # a device step's input

    def one_token_moe(self) -> OneTokenMoE:
        if self._one_token_moe is None:
            self._one_token_moe = OneTokenMoE(self.lm)
        return self._one_token_moe

    def one_token_attention(self) -> OneTokenAttention:
        if self._attention is None:
            self._attention = OneTokenAttention(self.lm, self.device)
        return self._attention

    @property
    def steps(self) -> str:
        """The requested way of stepping, `auto` resolved."""
        if self.requested != AUTO:
            return self.requested
        single = not dist.is_initialized() or dist.get_world_size() == 1
        if (self.device.type == "cuda" and single and self.one_token_moe().complete
                and self.one_token_attention().complete):
            return GRAPH
        return SYNC_FREE

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

    def _context_for(self, length: int):
        """The inference context, kept while answers fit (a graphed step holds its tensors), else a longer one."""
        from megatron.core.inference.contexts import StaticInferenceContext

        if self._context is None or self._context.max_sequence_length < length:
            self._graph = None
            self._context = StaticInferenceContext(max_batch_size=1,
                                                   max_sequence_length=-(-length // CACHE_ROOM) * CACHE_ROOM)
        self._context.reset()
        return self._context

    def _layers(self, steps: str):
        """The one-token layers that `steps` uses, active while decoding."""
        layers = ExitStack()
        if steps != WAITING:
            layers.enter_context(self.one_token_moe().active())
        if steps in (DEVICE, GRAPH):
            layers.enter_context(self.one_token_attention().active())
        return layers

    def prompt_positions(self, prompt) -> tuple[torch.Tensor, int]:
        """The prompt's position ids on the device ([A, 1, L] from its format's positions hook, else [1, L]) and how
        far the answer's positions run ahead of its tokens' places (Qwen's images take fewer positions than
        tokens: the next token's position is the largest + 1)."""
        length = prompt.input_ids.shape[1]
        if prompt.position_ids is None:
            return torch.arange(length, device=self.device)[None], 0
        positions = prompt.position_ids.to(self.device)
        return positions, int(prompt.position_ids.max()) + 1 - length

    def _step(self, steps: str, context, length: int, shift: int = 0):
        """A function of the chosen token ([1, 1] on the device) that returns the next logits, after the prompt
        (the answer's positions `shift` ahead of their places in the cache)."""
        lm = self.lm
        if steps in (WAITING, SYNC_FREE):
            positions = torch.arange(context.max_sequence_length, device=self.device)[None] + shift

            def host_step(token):
                offset = context.sequence_len_offset
                return lm(input_ids=token, position_ids=positions[:, offset:offset + 1], attention_mask=None,
                          inference_context=context, runtime_gather_output=True)
            return host_step
        attention = self.one_token_attention()
        attention.start(context, length)

        def run():  # from fixed buffers: the token in self._token, the position on the device
            logits = lm(input_ids=self._token, position_ids=attention.position.view(1, 1), attention_mask=None,
                        inference_context=context, runtime_gather_output=True)
            attention.position.add_(1)
            return logits
        if steps == GRAPH and self._graph is None:  # None: not tried for this cache; False: capture failed
            state = [t for pair in context.key_value_memory_dict.values() for t in pair]
            self._graph = capture(run, [*state, attention.position]) or False
        replay = self._graph if steps == GRAPH and self._graph else run

        def device_step(token):
            self._token.copy_(token)
            return replay()
        return device_step

    @torch.no_grad()
    def generate(self, prompt, *, max_new_tokens: int, stop_ids: frozenset[int], sampler) -> Generated:
        """Up to `max_new_tokens` tokens after `prompt` (an `EncodedPrompt`), ending at a token of `stop_ids`.

        Past `waiting`, a step never waits for the GPU: the chosen tokens stay on the device and the host looks
        for a stop token every `STOP_CHECK_EVERY` steps (the steps after a stop are computed and dropped)."""
        from megatron.core.inference.utils import InferenceMode

        input_ids = prompt.input_ids.to(self.device)
        length = input_ids.shape[1]
        positions, shift = self.prompt_positions(prompt)
        steps = self.steps
        if shift and steps in (DEVICE, GRAPH):  # their position is the cache's place: host positions instead
            steps = SYNC_FREE
        context = self._context_for(length + max_new_tokens)
        modality_inputs = to_device(prompt.modality_inputs, self.device, self.params_dtype)
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        check_every = 1 if steps == WAITING else STOP_CHECK_EVERY
        chosen = torch.empty(max(max_new_tokens, 1), dtype=torch.long, device=self.device)
        stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=self.device) if stop_ids else None
        count, checked = 0, 0
        with eval_mode(self.model), InferenceMode.active(), self._layers(steps):
            started = time.perf_counter()
            combined = self.prompt_embeddings(input_ids, modality_inputs)
            logits = self.lm(input_ids=None, position_ids=positions, decoder_input=combined, attention_mask=None,
                             inference_context=context, runtime_gather_output=True)
            context.increment_sequence_len_offset(length)
            step = self._step(steps, context, length, shift)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            prefilled = time.perf_counter()
            for index in range(max_new_tokens):
                token = sampler.choose(logits[0, -1])  # [1, 1]
                if distributed:
                    dist.broadcast(token, src=0)
                chosen[index:index + 1].copy_(token.view(1))
                count = index + 1
                if count == max_new_tokens:
                    break
                if stops is not None and count - checked >= check_every:
                    # the one host sync, every check_every steps
                    if bool(torch.isin(chosen[checked:count], stops).any()):
                        break
                    checked = count
                logits = step(token)
                context.increment_sequence_len_offset(1)
            tokens = chosen[:count].tolist()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            finished = time.perf_counter()
        end = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
        steps_run = count - 1  # forward passes after the prefill
        if end is not None:
            return Generated(tokens[:end], STOP_END, prefilled - started, finished - prefilled, steps_run)
        return Generated(tokens, STOP_LENGTH, prefilled - started, finished - prefilled, steps_run)
