"""`--encoder-pass step`: the encoders run once per training step, on every micro-batch's inputs at once, instead
of once per micro-batch.

A vision encoder fed one micro-batch's images (a single image at micro-batch 1) launches all its kernels for a
few milliseconds of GPU work each time: on one GPU the host, not the GPU, then sets the pace (RADIO-H: about 80 ms
of launches for 15 ms of GPU work per micro-batch). Run once per step, the same launches carry all the step's
images. The step:

1. reads all its micro-batches, moves their encoder inputs to the device, concatenates each modality's with the
   provider's `concat_encoder_inputs` hook, and runs each encoder once (`forward`);
2. cuts the output into each micro-batch's rows (the micro-batch's placeholders, counted on the host) and hands
   each micro-batch detached copies as its encoder embeddings; megatron-core's schedule runs the language model's
   forward and backward per micro-batch as before, which leaves the gradient of each copy in its `.grad`;
3. after the last micro-batch's backward, before gradients are reduced, runs the encoders' backward once with
   those gradients (`backward`).

Values and gradients are those of running the encoders per micro-batch (the encoders treat each image on its own),
up to the order of floating-point sums; random draws (dropout) come in another order. The encoders' activations of
the whole step are kept until its end: `mimo plan` counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mimo.errors import UsageError
from mimo.plugins import LANGUAGE

from ..parallel.layout import Layout
from .batch_transfer import to_device


@dataclass
class EncodedBatch:
    """A micro-batch whose encoders already ran: `embeddings` {modality: [placeholders, hidden]}."""

    batch: dict
    embeddings: dict[str, torch.Tensor]


def step_encoders(mode: str, *, hooks, parallelism: dict, device: str) -> bool:
    """Whether a run's encoders run once per step: `mode` is --encoder-pass; `device` the run's device option.
    `auto` chooses it on a GPU where it can run; `step` where it cannot is one line."""
    if Layout(parallelism).stages_beside_encoders:  # the encoders leave the LLM's pipeline (encoders_beside_stages)
        if mode == "micro-batch":
            raise UsageError("--encoder-pass micro-batch cannot run the encoders beside the LLM's pipeline stages "
                             "(--llm-pp with colocated encoders): use --encoder-pass step or auto")
        if not _concatenates(hooks):
            raise UsageError("--llm-pp with colocated encoders runs them once per step, which needs the provider's "
                             "concat_encoder_inputs hook: give the encoders ranks of their own (--encoder-ranks)")
        return True
    if mode == "micro-batch":
        return False
    reason = _unsupported(hooks, parallelism)
    if mode == "step" and reason:
        raise UsageError(f"--encoder-pass step: {reason}; use --encoder-pass micro-batch (or auto)")
    if mode == "auto":
        return not reason and _gpu(device)
    return True


def fit_auto(plan, fits) -> None:
    """--encoder-pass auto, once per step chosen: keep it where the step's encoder activations fit the GPU
    (`fits(plan)`, the memory check's rule). Where they fit only recomputed and --recompute leaves the encoders
    alone, recompute them fully (once per step it costs one batched encoder forward: 325 against 336 TFLOP/s on the
    Nemotron slice, docs/benchmarks.md (g)); else run the encoders once per micro-batch. The choice is made alike
    on every rank (the same options and GPU model)."""
    if not plan.step_encoders or plan.config.performance.encoder_pass != "auto" or fits(plan) \
            or plan.layout.stages_beside_encoders:  # the only way these stages run
        return
    performance = plan.config.performance
    modes = performance.recompute_modes()
    encoders = [name for name in plan.parallelism if name != LANGUAGE]
    if not any(name in modes for name in encoders) and modes.get("*", "none") == "none":
        original = performance.recompute
        performance.recompute = ",".join(f"{k}={v}" for k, v in {**modes, **dict.fromkeys(encoders, "full")}.items())
        if fits(plan):
            plan.encoders_recomputed = True
            return
        performance.recompute = original
    plan.step_encoders = False


def _unsupported(hooks, parallelism: dict) -> str | None:
    layout = Layout(parallelism)
    if not layout.encoders:
        return "the model has no encoders"
    if not layout.colocated:
        return "the encoders have ranks of their own (--encoder-ranks), where the pipeline schedule feeds them"
    if layout.shared_ranks_exchange:
        return "the colocated encoders run at a TP of their own (--encoder-tp), reading other samples than the LLM"
    if not _concatenates(hooks):
        return "the provider does not implement the concat_encoder_inputs hook"
    return None


def _concatenates(hooks) -> bool:
    return bool(hooks.concat_encoder_inputs.get_hookimpls())


def _gpu(device: str) -> bool:
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


class StepEncoderPass:
    """The encoders of a colocated model run once per step (see the module's docstring)."""

    def __init__(self, model, *, hooks, settings, device: torch.device, params_dtype: torch.dtype):
        self.model, self.hooks, self.settings = model, hooks, settings
        self.device, self.params_dtype = device, params_dtype
        self._pending: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def forward(self, batches: list[dict]) -> list[EncodedBatch]:
        """Run every encoder once over `batches`' inputs; each batch with its share of the embeddings."""
        self._pending.clear()
        shares: list[dict[str, torch.Tensor]] = [{} for _ in batches]
        special = self.model.special_token_ids
        for modality, encoder in self.model.modality_submodules.items():
            present = [k for k, b in enumerate(batches) if (b.get("modality_inputs") or {}).get(modality) is not None]
            if not present:
                continue
            # each micro-batch's inputs go to the device from the read-ahead's pinned memory, and are concatenated
            # there: a step's images concatenated on the host (the Nemotron slice: 8 images, 34 MB) kept the GPU
            # waiting about 20 ms at the step's start
            inputs = [to_device(batches[k]["modality_inputs"][modality], self.device, self.params_dtype)
                      for k in present]
            merged = self.hooks.concat_encoder_inputs(settings=self.settings, modality=modality, inputs=inputs)
            if merged is None:
                raise UsageError(f"--encoder-pass step: the provider cannot concatenate the {modality} inputs of "
                                 f"several micro-batches; use --encoder-pass micro-batch")
            output = encoder(encoder_inputs=merged)
            counts = [int((batches[k]["input_ids"] == special[modality]).sum()) for k in present]
            if sum(counts) != output.shape[0]:
                raise ValueError(f"Number of {modality} tokens ({sum(counts)}) does not match number of {modality} "
                                 f"embeddings ({output.shape[0]})")
            parts = list(output.split(counts))
            copies = [part.detach().requires_grad_(output.requires_grad) for part in parts]
            for k, copy in zip(present, copies):
                shares[k][modality] = copy
            if output.requires_grad:
                self._pending.append((parts, copies))
        return [EncodedBatch(batch, share) for batch, share in zip(batches, shares)]

    def backward(self) -> None:
        """The encoders' backward, once, with the gradients the micro-batches left on their embeddings."""
        outputs, grads = [], []
        for parts, copies in self._pending:
            for part, copy in zip(parts, copies):
                if copy.grad is not None:
                    outputs.append(part)
                    grads.append(copy.grad)
        self._pending.clear()
        if outputs:
            torch.autograd.backward(outputs, grads)
