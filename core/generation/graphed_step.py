"""The language model's one-token step as a CUDA graph: captured once per decoder and cache, replayed per token.

A decode step of a hybrid Mamba/MoE/attention model is a few hundred small kernels that megatron-core's Python
launches layer by layer; on a GPU the host takes longer to launch them than the GPU to run them. Captured once, a
step is one graph launch. What a step reads or writes keeps its address from step to step: the input token and
position buffers, the inference context's key/value and Mamba state tensors, the stacked expert weights, the
logits; the position advances on the device inside the graph (one_token_attention.py), and no layer of the step
may wait for the host (one_token_moe.py).

Capture runs the step first (twice, on a side stream: lazy initialisation, kernel compilation and autotuning stay
out of the graph), which moves the Mamba states and the position on: both are put back before the graph is
recorded, so the step that follows is the first one counted.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

WARMUP_STEPS = 2


class GraphedStep:
    """`run()` computes one step eagerly from fixed buffers and returns its logits; `GraphedStep(run, state)`
    captures it (`state`: every tensor the step changes in place). Call the object to replay: it returns the
    same logits tensor, rewritten."""

    def __init__(self, run, state: list[torch.Tensor]):
        kept = [t.clone() for t in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                for _ in range(WARMUP_STEPS):
                    run()
        finally:
            torch.cuda.current_stream().wait_stream(side)
            for tensor, saved in zip(state, kept):
                tensor.copy_(saved)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = run()

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


def capture(run, state: list[torch.Tensor]) -> GraphedStep | None:
    """The graphed step, or None (logged) when a layer of the step cannot be captured: decoding then runs the
    step eagerly, with the same results."""
    try:
        return GraphedStep(run, state)
    except RuntimeError as error:  # e.g. a layer that waits for the host inside the step
        log.warning("decoding without a CUDA graph (the step could not be captured: %s)",
                    str(error).splitlines()[0] if str(error) else type(error).__name__)
        return None
