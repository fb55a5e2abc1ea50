"""`--cuda-graphs`: the language model's layers captured as transformer-engine CUDA graphs by megatron-core's
TECudaGraphHelper, then replayed, so each layer's forward and backward launch as one graph instead of dozens of
kernels from Python. The loop drives it as Megatron-LM's does: eager iterations first, capture once, replay."""

from __future__ import annotations

from ..parallel.topology import LANGUAGE, Topology

EAGER_ITERATIONS = 1  # the first iteration runs eagerly (allocator, TE's first-use setup), then capture


def train_on_capture_stream() -> None:
    """Make the stream torch captures graphs on this process's current stream, before the model is built.

    megatron-core's DDP keeps every parameter's gradient-accumulation node from the moment it wraps the model, and
    autograd runs that node on the stream that was current then. Built on the default stream, a layer's backward
    captured on a side stream would make the default stream wait on the capture, which CUDA refuses
    (cudaErrorStreamCaptureImplicit). On one stream for everything, capture and training never cross streams.
    """
    import torch

    stream = torch.cuda.Stream()
    torch.cuda.graph.default_capture_stream = stream
    torch.cuda.set_stream(stream)


class LayerGraphs:
    def __init__(self, *, model, optimizer, topology: Topology, seq_length: int, micro_batch_size: int,
                 num_microbatches: int):
        from megatron.core import num_microbatches_calculator as calculator
        from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

        self.helper = None
        self.steps = 0
        if topology.holds(LANGUAGE):  # an encoder-only rank has no language layers to capture
            # The helper reads the micro-batches per step from megatron-core's global calculator (its warm-up count
            # and, with PP, the schedule it captures); mimo's schedule has these per step, no ramp-up.
            calculator.unset_num_microbatches_calculator()
            calculator.init_num_microbatches_calculator(
                rank=0, global_batch_size=micro_batch_size * num_microbatches, micro_batch_size=micro_batch_size,
                data_parallel_size=1)
            language = model.language_model
            self.gathers_params_in_forward = language.ddp_config.overlap_param_gather
            self.helper = TECudaGraphHelper(model=[language], config=language.config, seq_length=seq_length,
                                            micro_batch_size=micro_batch_size, optimizers=[optimizer],
                                            pg_collection=topology.pg_collections[LANGUAGE])

    def before_step(self) -> None:
        """Capture before the first step after the eager ones; afterwards the layers replay their graphs."""
        self.steps += 1
        if self.helper is not None and self.steps == EAGER_ITERATIONS + 1:
            self.helper.create_cudagraphs()
            if self.gathers_params_in_forward:  # replayed layers skip the forward pre-hooks that gather them
                self.helper.cuda_graph_set_manual_hooks()
