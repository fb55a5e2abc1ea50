"""--cuda-graphs for the Qwen3.5 language model: which parts of its layers the loop captures (megatron-core's
`cuda_graph_modules`, captured by its TECudaGraphHelper after one eager iteration), or why it cannot.

* `attn`: every layer's mixer with its input norm. In `G` layers that is the gated delta net, whose
  flash-linear-attention kernels take fixed shapes without reading anything on the host when the input is not packed
  (their Triton autotuning runs in the eager iteration before capture); in `*` layers the gated attention, its
  multimodal rotary frequencies a static input of the graph (layers.MRoPEAttentionLayer).
* `moe_router`: each MoE layer's router and its shared expert (with its gate) too, where the routed experts are the
  kit's grouped GEMMs (mimo.plugins.kit.grouped_mm_moe; the `expert_gemm` setting), LLM TP and expert TP 1, no FP8
  and no LLM recomputation: the conditions Nemotron's provider captures its routers under. The routed experts stay
  eager (their token counts change every micro-batch).

Packed --data gives other shapes every micro-batch, and packed rows make flash-linear-attention read the sequence
boundaries on the host: refused. Full recomputation of the LLM's layers: megatron-core captures layer graphs only
without it. None of this has run on a GPU yet (README.md).
"""

from __future__ import annotations

from mimo import LANGUAGE

from .settings import Qwen35Settings
from .specs import uses_grouped_mm


def cuda_graph_fields(s: Qwen35Settings, ctx, backend: str) -> dict:
    """The language model's TransformerConfig fields for --cuda-graphs (none without it); ValueError in one line
    where the run cannot capture its layers."""
    if not ctx.cuda_graphs:
        return {}
    if backend != "te":
        raise ValueError("--cuda-graphs needs backend te: --set backend=te (transformer-engine, fla, a GPU)")
    if ctx.llm_input_packed:
        raise ValueError("--cuda-graphs: packed --data gives the LLM sequences of another length every micro-batch "
                         "(and flash-linear-attention reads packed rows' boundaries on the host), which captured "
                         "graphs cannot replay; add --no-pack-sequences or leave --cuda-graphs off")
    if ctx.recompute.get(LANGUAGE, "none") == "full":
        raise ValueError("--cuda-graphs with --recompute full for the language model: megatron-core captures its "
                         "layers only without full recomputation; use --recompute language=selective (or none), "
                         "or leave --cuda-graphs off")
    wanted = ["attn"]
    if routers_graphable(s, ctx, backend):
        wanted.append("moe_router")
    return {"cuda_graph_modules": wanted}


def routers_graphable(s: Qwen35Settings, ctx, backend: str) -> bool:
    """The MoE layers' routers (and shared experts) as CUDA graphs: where the routed experts are the kit's grouped
    GEMMs (nothing in the layer waits for the host), the LLM unsplit by tensor parallelism, no FP8 (its padded
    routing) and no recomputation of the LLM (megatron-core refuses router graphs beside some choices)."""
    language = ctx.parallelism[LANGUAGE]
    return (s.is_moe and s.num_experts > 1 and uses_grouped_mm(s.expert_gemm, backend)
            and ctx.fp8 == "none" and language.tp == 1 and language.expt_tp == 1
            and ctx.recompute.get(LANGUAGE, "none") == "none")
