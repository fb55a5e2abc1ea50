"""The Qwen3.5 language model as a megatron-core spec: GPTModel over the family's hybrid layers (specs.py), with
interleaved multimodal RoPE (layers.InterleavedMRoPE) on the full attention layers."""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from mimo import LANGUAGE
from mimo.plugins.kit.in_place_loss import InPlaceCrossEntropy
from mimo.plugins.kit.te_extras import te_extras_enabled

from .graphs import cuda_graph_fields
from .layers import InterleavedMRoPE
from .settings import Qwen35Settings
from .specs import final_norm, layer_specs, resolve_backend


class Qwen35LanguageModel(InPlaceCrossEntropy, GPTModel):
    """megatron-core's GPTModel with one layer spec per layer (`layer_specs`, the whole model: each pipeline stage
    builds its own slice) and interleaved MRoPE. `position_ids` are text positions [B, S] or 3-D ones [3, B, S]
    (temporal, height, width: what image grids give); the fused loss reuses the logits' buffer (kit)."""

    def __init__(self, config, layer_specs: list, final_norm, pg_collection=None, vp_stage=None, **kwargs):
        pp_rank = pg_collection.pp.rank() if pg_collection is not None else 0
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        block = TransformerBlockSubmodules(layer_specs=layer_specs[offset:offset + count], layer_norm=final_norm)
        super().__init__(config, block, position_embedding_type="mrope", pg_collection=pg_collection,
                         vp_stage=vp_stage, **kwargs)
        # same constructor and no parameters: the interleaved layout replaces megatron-core's sectioned one
        self.rotary_pos_emb = InterleavedMRoPE(
            kv_channels=config.kv_channels, rotary_percent=kwargs.get("rotary_percent", 1.0),
            rotary_interleaved=config.rotary_interleaved, rotary_base=kwargs.get("rotary_base", 10000),
            cp_group=self.pg_collection.cp)

    def forward(self, *args, inference_context=None, inference_params=None, **kwargs):
        # decoding: the rotary module keeps the frequencies of the positions so far (InterleavedMRoPE)
        self.rotary_pos_emb.context = inference_context if inference_context is not None else inference_params
        try:
            return super().forward(*args, inference_context=inference_context, inference_params=inference_params,
                                   **kwargs)
        finally:
            self.rotary_pos_emb.context = None


def transformer_fields(s: Qwen35Settings) -> dict:
    """The TransformerConfig fields of the language model's shape and numerics."""
    fields = dict(
        num_layers=s.num_layers, hidden_size=s.hidden_size, num_attention_heads=s.num_attention_heads,
        num_query_groups=s.num_query_groups, kv_channels=s.kv_channels, ffn_hidden_size=s.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=s.norm_epsilon, layernorm_zero_centered_gamma=True,
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, qk_layernorm=True,
        attention_output_gate=True, mrope_section=list(s.mrope_section), hidden_dropout=s.dropout,
        attention_dropout=s.dropout, init_method_std=s.init_method_std,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[1 if c == "G" else 0 for c in s.layer_pattern],
        linear_conv_kernel_dim=s.linear_conv_kernel, linear_key_head_dim=s.linear_key_head_dim,
        linear_value_head_dim=s.linear_value_head_dim, linear_num_key_heads=s.linear_num_key_heads,
        linear_num_value_heads=s.linear_num_value_heads,
    )
    if s.is_moe:
        fields.update(
            num_moe_experts=s.num_experts, moe_router_topk=s.moe_router_topk, moe_ffn_hidden_size=s.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=s.moe_shared_expert_intermediate_size, moe_shared_expert_gate=True,
            # softmax over the top k logits: transformers' softmax over all, top k, renormalized
            moe_router_score_function="softmax", moe_router_pre_softmax=False, moe_router_dtype="fp32",
            moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=s.moe_aux_loss_coeff)
    return fields


def language_spec(s: Qwen35Settings, ctx) -> ModuleSpec:
    backend = resolve_backend(s.backend)
    llm = ctx.parallelism[LANGUAGE]
    if s.is_moe and llm.tp > 1 and not ctx.sequence_parallel:
        raise ValueError("--llm-tp > 1: megatron-core trains MoE layers under tensor parallelism only with "
                         "sequence parallelism: add --sequence-parallel, or use --llm-tp 1 (and --llm-ep)")
    graphs = cuda_graph_fields(s, ctx, backend)
    if backend != "te":
        if ctx.fp8 != "none":
            raise ValueError(f"--fp8 {ctx.fp8} needs backend te: --set backend=te (transformer-engine, fla, a GPU)")
        if ctx.sequence_parallel and llm.tp > 1:
            raise ValueError("--sequence-parallel needs backend te: --set backend=te, or leave it off")
        if llm.cp > 1:
            raise ValueError(f"--llm-cp {llm.cp} needs backend te (the gated delta net's context parallelism is "
                             f"flash-linear-attention's): --set backend=te, or --llm-cp 1")
    for count, what in ((s.linear_num_key_heads, "linear_num_key_heads"),
                        (s.linear_num_value_heads, "linear_num_value_heads")):
        if count % (llm.tp * llm.cp):
            raise ValueError(f"{what} {count} must divide by the LLM's TP x CP = {llm.tp * llm.cp}")
    fused = {}
    if backend == "te":
        fused["bias_dropout_fusion"] = True
        if te_extras_enabled():
            fused.update(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
        if s.is_moe:
            fused.update(moe_grouped_gemm=True, moe_permute_fusion=True)
    config = ctx.transformer_config(LANGUAGE, **transformer_fields(s), **fused, **graphs)
    return ModuleSpec(module=Qwen35LanguageModel, params=dict(
        config=config, layer_specs=layer_specs(s.layer_pattern, backend, s.num_experts, s.expert_gemm),
        final_norm=final_norm(backend), vocab_size=s.vocab_size, max_sequence_length=s.seq_length,
        share_embeddings_and_output_weights=s.tie_word_embeddings, rotary_percent=s.rotary_percent,
        rotary_base=s.rotary_base,
        scatter_embedding_sequence_parallel=False,  # MimoModel scatters the combined embeddings itself
        pre_process=ctx.is_first_stage(LANGUAGE), post_process=ctx.is_last_stage(LANGUAGE),
        pg_collection=ctx.pg_collection(LANGUAGE),
    ))
