"""A fully recomputed transformer block whose forward replays a CUDA graph per bucket of packed token counts.

Under full recompute (megatron-core's recompute_granularity='full': each layer keeps only its input and runs again
in backward) the forward needs no autograd: it is kernel launches only. For a ViT over a whole step's images
(RADIO: 32 layers, each dozens of kernels launched from Python) the host takes about three times longer to launch
them than the GPU to run them, and the GPU waits: about 90 ms per step of the Nemotron slice on an H100
(docs/benchmarks.md (g)). `RecomputeGraphs` captures that no-grad forward once per bucket of packed (THD) token
counts as one CUDA graph, which writes each layer's output into a buffer the backward reads, and replays it.
Backward recomputes each layer eagerly from its kept input, last layer first, as megatron-core's
CheckpointFunction does; with `backward`, each layer's recompute and backward replay graphs too. The packed input
is padded to its bucket with a padding sequence, which attends only to itself and is dropped from the output, so a
step's images need no fixed size.

Off the GPU (tests) the same padding, buffers and backward run, eager in place of the graphs.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class _Bucket:
    """One captured shape: the first layer's input buffer, its THD boundaries on the device, and the graph."""
    x: torch.Tensor  # [tokens, 1, hidden]
    cu_seqlens: torch.Tensor  # [sequences + 1] int32
    params: PackedSeqParams
    graph: object | None  # torch.cuda.CUDAGraph; None off the GPU
    # with graphed backward: each layer's recompute-and-backward (a graph's replay, or off the GPU the eager call),
    # reading and writing the two gradient buffers [2, tokens, 1, hidden] in turn
    backward: list | None = None
    grads: torch.Tensor | None = None


# The default buckets: a step's packed tokens, its sequence count, its longest sequence (bench/encoder_buckets.py
# counts what other token buckets would pad and capture)
TOKEN_BUCKET, SEQUENCE_BUCKET, SEQLEN_BUCKET = 2048, 1, 1024


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _boundaries(lengths: list[int]) -> torch.Tensor:
    """THD boundaries (int32, on the host) of sequences of `lengths` packed one after another."""
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)


def padded_lengths(lengths: list[int], token_bucket: int, sequence_bucket: int) -> list[int]:
    """`lengths` followed by at least one padding sequence (each of one token or more), so that the sequence
    count is a multiple of `sequence_bucket` and the token count a multiple of `token_bucket`."""
    slots = _round_up(len(lengths) + 1, sequence_bucket)
    pads = slots - len(lengths)
    tokens = sum(lengths)
    extra = _round_up(tokens + pads, token_bucket) - tokens
    return lengths + [extra // pads + (1 if i < extra % pads else 0) for i in range(pads)]


def bucket_key(padded: list[int], seqlen_bucket: int) -> tuple[int, int, int]:
    """(tokens, sequences, longest sequence rounded up to `seqlen_bucket`) of `padded` lengths: one graph each.
    Attention kernels (cuDNN's THD) cost about sequences x max_seqlen: both bucketed tight, not to the maximum."""
    return sum(padded), len(padded), _round_up(max(padded), seqlen_bucket)


class RecomputeGraphs:
    """Replaces `block.forward` (a megatron-core TransformerBlock configured for full recompute) where it applies:
    training, gradients on, a THD-packed input with the host-side sequence lengths given in `lengths` by the caller
    just before the call (reading them from the device would wait for the GPU), no dropout, no FP8, no sequence
    parallelism. Elsewhere, and while an earlier graphed forward still waits for its backward (a pipeline schedule
    with several micro-batches in flight), the block's own forward runs.

    `backward`: replay each layer's recompute and backward as a graph per bucket too, over the padded tokens with
    the padding's gradients zero. Its parameters' gradients go into megatron-core DDP's `main_grad` buffers inside
    the graph (transformer-engine's weight-gradient GEMMs add there themselves), so DDP's per-parameter hooks do not
    run: not with DDP's overlapped gradient reduction, which counts on them. Needs every parameter to have a
    `main_grad` (megatron-core DDP); else the eager backward runs.

    `max_seqlen`: the longest sequence the caller can pass; buckets of `token_bucket` tokens, `sequence_bucket`
    sequences (one padding sequence at 1) and a longest sequence rounded up to `seqlen_bucket`. Each new bucket
    costs one eager run and a capture of what it replays; the layer outputs' buffer holds the most tokens that many
    sequences can have, and every bucket captures again when more sequences than ever before make it grow."""

    def __init__(self, block, *, max_seqlen: int, token_bucket: int = TOKEN_BUCKET,
                 sequence_bucket: int = SEQUENCE_BUCKET, seqlen_bucket: int = SEQLEN_BUCKET, backward: bool = False):
        self.block, self.layers = block, list(block.layers)
        self.backward = backward
        self.max_seqlen = max_seqlen
        self.token_bucket, self.sequence_bucket, self.seqlen_bucket = token_bucket, sequence_bucket, seqlen_bucket
        self.lengths: list[int] | None = None  # the next call's sequence lengths, set by the caller
        self.captures: list[tuple[int, float]] = []  # (tokens, seconds) of each capture, for the logs
        self.failure: str | None = None
        self._buckets: dict[tuple[int, int, int], _Bucket] = {}
        self._outputs: torch.Tensor | None = None  # [layers, tokens, 1, hidden]: layer l's output
        self._pool = None
        self._in_flight = 0
        self._eager_forward = block.forward
        block.forward = self.forward  # an instance attribute: nn.Module.__call__ finds it before the class's

    def forward(self, hidden_states, attention_mask=None, *args, packed_seq_params=None, **kwargs):
        lengths, self.lengths = self.lengths, None
        if not self._applies(hidden_states, attention_mask, args, packed_seq_params, lengths, kwargs):
            return self._eager_forward(hidden_states, attention_mask, *args, packed_seq_params=packed_seq_params,
                                       **kwargs)
        padded = padded_lengths(lengths, self.token_bucket, self.sequence_bucket)
        bucket = self._bucket(hidden_states, lengths, padded)
        if bucket is None:  # the capture failed (said once): megatron-core's recompute from now on
            return self._eager_forward(hidden_states, attention_mask, packed_seq_params=packed_seq_params)
        tokens = hidden_states.shape[0]
        if hidden_states.requires_grad:
            out = _GraphedCheckpoints.apply(self, bucket, packed_seq_params, padded, hidden_states)
        else:  # nothing to differentiate (a frozen encoder): the replay alone
            out = self._replay(bucket, hidden_states, padded)[:tokens].clone()
        if self.block.final_layernorm is not None:
            out = self.block.final_layernorm(out)
        return out

    def _applies(self, hidden, attention_mask, args, params, lengths, kwargs) -> bool:
        c = self.block.config
        return (self.failure is None and self._in_flight == 0 and lengths is not None and params is not None
                and self.block.training and torch.is_grad_enabled() and c.recompute_granularity == "full"
                and params.qkv_format == "thd" and attention_mask is None and not args
                and all(v is None for v in kwargs.values()) and hidden.dim() == 3 and hidden.shape[1] == 1
                and sum(lengths) == hidden.shape[0] and max(lengths) <= self.max_seqlen
                and not c.hidden_dropout and not c.attention_dropout and not c.fp8 and not c.sequence_parallel
                and self.block.pre_process and bool(self.layers))

    def _bucket(self, hidden: torch.Tensor, lengths: list[int], padded: list[int]) -> _Bucket | None:
        key = bucket_key(padded, self.seqlen_bucket)
        tokens, _, max_seqlen = key
        bucket = self._buckets.get(key)
        if bucket is not None:
            return bucket
        if self._outputs is None or self._outputs.shape[1] < tokens:  # graphs write into it: capture them again
            self._buckets.clear()
            self._outputs = None
            # room for the most tokens these many sequences can have, so that a larger bucket later does not make
            # every bucket capture again (only more sequences than ever before do)
            most = sum(padded_lengths([self.max_seqlen] * len(lengths), self.token_bucket, self.sequence_bucket))
            capacity = max(tokens, most)
            self._outputs = hidden.new_zeros(len(self.layers), capacity, 1, hidden.shape[-1])
        cu = _boundaries(padded).to(hidden.device)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen,
                                 max_seqlen_kv=max_seqlen)
        bucket = _Bucket(x=hidden.new_zeros(tokens, 1, hidden.shape[-1]), cu_seqlens=cu, params=params, graph=None)
        if hidden.is_cuda or (self.backward and hidden.requires_grad):
            started = time.perf_counter()
            try:
                if hidden.is_cuda:
                    bucket.graph = self._captured(lambda: self._layers(bucket))
                if hidden.requires_grad:
                    self._graphed_backward(bucket, hidden)
            except Exception as err:  # noqa: BLE001 - any capture failure: the eager recompute still trains
                self.failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                warnings.warn(f"the encoder's recomputed forward runs without CUDA graphs: capturing it failed "
                              f"({self.failure})", stacklevel=2)
                return None
            self.captures.append((tokens, time.perf_counter() - started))
            if hidden.is_cuda and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
                print(f"recomputed layers ({len(self.layers)}): CUDA graph for {tokens} tokens in {len(padded)} "
                      f"sequences captured in {self.captures[-1][1]:.2f} s ({len(self.captures)} so far)", flush=True)
        self._buckets[key] = bucket
        return bucket

    @torch.no_grad()
    def _layers(self, bucket: _Bucket) -> None:
        """The bucket's forward: every layer over the padded tokens, its output into the outputs' buffer."""
        tokens = bucket.x.shape[0]
        hidden = bucket.x
        for index, layer in enumerate(self.layers):
            hidden, _ = layer(hidden_states=hidden, attention_mask=None, packed_seq_params=bucket.params)
            self._outputs[index, :tokens].copy_(hidden)
            hidden = self._outputs[index, :tokens]

    def _layer_backward(self, bucket: _Bucket, index: int) -> None:
        """Layer `index` recomputed over the bucket's padded tokens and differentiated: the upstream gradient from
        one gradient buffer, the input's gradient into the other, parameter gradients added to `main_grad`."""
        tokens, count = bucket.x.shape[0], len(self.layers)
        kept = bucket.x if index == 0 else self._outputs[index - 1, :tokens]
        upstream, result = bucket.grads[(count - 1 - index) % 2], bucket.grads[(count - index) % 2]
        layer = self.layers[index]
        params = [p for p in layer.parameters() if p.requires_grad]
        with torch.enable_grad():
            inp = kept.detach().requires_grad_()
            out, _ = layer(hidden_states=inp, attention_mask=None, packed_seq_params=bucket.params)
            grads = torch.autograd.grad(out, [inp, *params], upstream, allow_unused=True)
        result.copy_(grads[0])
        for param, grad in zip(params, grads[1:]):
            # transformer-engine's weight-gradient GEMM already added it (its returned tensor is a placeholder)
            if grad is not None and not getattr(param, "grad_added_to_main_grad", False):
                param.main_grad.add_(grad)

    def _graphed_backward(self, bucket: _Bucket, hidden: torch.Tensor) -> None:
        if not (self.backward and all(hasattr(p, "main_grad") for p in self.block.parameters() if p.requires_grad)):
            return
        bucket.grads = hidden.new_zeros(2, *bucket.x.shape)
        steps = [lambda index=index: self._layer_backward(bucket, index) for index in range(len(self.layers))]
        if hidden.is_cuda:  # upstream gradients of zero: the eager run before each capture adds nothing
            steps = [self._captured(step).replay for step in steps[::-1]][::-1]
        bucket.backward = steps

    def _captured(self, run):
        """`run` captured as a CUDA graph, after one eager run (first-use setup and kernel choices happen outside).
        torch.cuda.graph's context would also collect garbage and empty the allocator's cache at every bucket;
        captures here are thread-local (the data's read-ahead thread may pin memory meanwhile), share one memory
        pool, and register the RNG tracker's generators as megatron-core's own graphs do."""
        from megatron.core.tensor_parallel.random import get_all_rng_states

        run()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        for generator in get_all_rng_states().values():
            if isinstance(generator, torch.Generator) and hasattr(graph, "register_generator_state"):
                graph.register_generator_state(generator)
        current = torch.cuda.current_stream()
        # CUDA refuses captures on the legacy default stream; mimo trains on a stream of its own with --cuda-graphs
        stream = current if current != torch.cuda.default_stream() else torch.cuda.Stream()
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                run()
            finally:
                graph.capture_end()
        current.wait_stream(stream)
        return graph

    def _replay(self, bucket: _Bucket, hidden: torch.Tensor, padded: list[int]) -> torch.Tensor:
        """Run the bucket's forward on `hidden`, packed as `padded` (its padding rows keep earlier values: finite,
        and only padding sequences read them); returns the last layer's output buffer (padded)."""
        tokens = hidden.shape[0]
        bucket.x[:tokens].copy_(hidden.detach())
        cu = _boundaries(padded)
        if hidden.is_cuda:
            cu = cu.pin_memory()
        bucket.cu_seqlens.copy_(cu, non_blocking=True)
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            self._layers(bucket)
        return self._outputs[-1, :bucket.x.shape[0]]


class _GraphedCheckpoints(torch.autograd.Function):
    """Forward: the bucket's graph; backward: each layer recomputed from its kept input, in reverse (replayed
    graphs over the padded tokens with `backward`, else eager over the real ones)."""

    @staticmethod
    def forward(ctx, runner: RecomputeGraphs, bucket: _Bucket, params: PackedSeqParams, padded: list[int],
                hidden: torch.Tensor):
        ctx.runner, ctx.bucket, ctx.tokens, ctx.params = runner, bucket, hidden.shape[0], params
        out = runner._replay(bucket, hidden, padded)
        runner._in_flight += 1
        return out[:hidden.shape[0]].clone()

    @staticmethod
    def backward(ctx, grad_output):
        runner, bucket, tokens = ctx.runner, ctx.bucket, ctx.tokens
        runner._in_flight -= 1
        if bucket.backward is not None:  # the padding's gradients are zero: it adds nothing to the parameters'
            bucket.grads[0, :tokens].copy_(grad_output)
            bucket.grads[0, tokens:].zero_()
            for step in reversed(bucket.backward):
                step()
            return None, None, None, None, bucket.grads[len(runner.layers) % 2, :tokens].clone()
        grad = grad_output
        with torch.enable_grad():
            for index in reversed(range(len(runner.layers))):
                kept = bucket.x if index == 0 else runner._outputs[index - 1]
                inp = kept[:tokens].detach().requires_grad_()
                out, _ = runner.layers[index](hidden_states=inp, attention_mask=None, packed_seq_params=ctx.params)
                torch.autograd.backward(out, grad)
                grad = inp.grad
        return None, None, None, None, grad
