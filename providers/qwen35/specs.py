"""Layer specs of the Qwen3.5 language model for both backends.

Every layer is a megatron-core TransformerLayer: its mixer is a gated delta net (`G`) or gated self-attention
(`*`), its MLP a SwiGLU MLP or a MoE layer (routed experts plus a gated shared expert). The input norm is fused into
the mixer's first linear (`linear_qkv`, `in_proj`) and, in dense layers, the MLP's norm into `linear_fc1`, as
transformer-engine fuses them; `local` builds the same layers from megatron-core's local pieces and mimo's kit
(SDPA attention, the fused norm-linear and zero-centered RMSNorm with TE's names), so both backends share every
parameter name. The norms store `w` and apply `1 + w` (`layernorm_zero_centered_gamma`), as Qwen's do, except the
gated delta net's output norm, which applies `w` (Qwen's RMSNormGated): it is always the package's `HeadNorm`.
The routed experts are megatron-core's, or (the `expert_gemm` setting) the kit's grouped-GEMM experts with the
token counts left on the device (mimo.plugins.kit.grouped_mm_moe), which keep megatron-core's parameters and keys.
Full attention layers are `MRoPEAttentionLayer`s (layers.py): the same layer, capturable with its rotary input.
"""

from __future__ import annotations

import importlib.util
from functools import partial

import torch
from megatron.core.extensions import transformer_engine as te
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules, HAVE_FLA
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from mimo.plugins import SDPAttention
from mimo.plugins.kit.grouped_mm_moe import uses_grouped_mm, with_grouped_mm_experts
from mimo.plugins.kit.local_norms import LayerNormColumnParallelLinear, RMSNorm

from .layers import HeadNorm, LocalGatedDeltaNet, MRoPEAttentionLayer, Qwen35GatedDeltaNet



def te_available() -> bool:
    """transformer-engine and flash-linear-attention both import, and a GPU is visible."""
    return te.HAVE_TE and HAVE_FLA and torch.cuda.is_available()


def resolve_backend(requested: str) -> str:
    if requested == "auto":
        requested = "te" if te_available() else "local"
    elif requested == "te" and not te_available():
        missing = [name for name, ok in (("transformer-engine", te.HAVE_TE),
                                         ("flash-linear-attention (fla)", importlib.util.find_spec("fla") is not None),
                                         ("a visible GPU", torch.cuda.is_available())) if not ok]
        raise ValueError(f"backend 'te' needs {', '.join(missing) or 'transformer-engine and fla'}; use "
                         f"backend=local (or auto)")
    return requested


def _pieces(backend: str) -> dict:
    """The modules each backend builds the layers from (identical parameter names)."""
    if backend == "te":
        return dict(norm_linear=te.TELayerNormColumnParallelLinear, column=te.TEColumnParallelLinear,
                    row=te.TERowParallelLinear, attention=te.TEDotProductAttention, norm=te.TENorm,
                    delta_net=Qwen35GatedDeltaNet)
    return dict(norm_linear=LayerNormColumnParallelLinear, column=ColumnParallelLinear, row=RowParallelLinear,
                attention=SDPAttention, norm=RMSNorm, delta_net=LocalGatedDeltaNet)


def _mixer(symbol: str, p: dict) -> ModuleSpec:
    if symbol == "G":
        return ModuleSpec(module=p["delta_net"], submodules=GatedDeltaNetSubmodules(
            in_proj=p["norm_linear"], out_norm=HeadNorm, out_proj=p["row"]))
    # attention_output_gate (config) makes linear_qkv also emit a sigmoid gate per query head
    return ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=SelfAttentionSubmodules(linear_qkv=p["norm_linear"], core_attention=p["attention"],
                                                         linear_proj=p["row"], q_layernorm=p["norm"],
                                                         k_layernorm=p["norm"]))


def layer_specs(pattern: str, backend: str, num_experts: int, expert_gemm: str = "megatron") -> list[ModuleSpec]:
    """One TransformerLayer spec per symbol of `pattern` (all of them: the model keeps its pipeline stage's)."""
    p = _pieces(backend)
    if num_experts:
        mlp = get_moe_module_spec(use_te=backend == "te", num_experts=num_experts, moe_grouped_gemm=backend == "te")
        pre_mlp_norm = p["norm"]
    else:
        mlp = partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=p["norm_linear"],
                                                                     linear_fc2=p["row"]))
        pre_mlp_norm = IdentityOp  # fused into linear_fc1
    specs = [ModuleSpec(module=TransformerLayer if symbol == "G" else MRoPEAttentionLayer,
                        submodules=TransformerLayerSubmodules(
                            self_attention=_mixer(symbol, p), self_attn_bda=get_bias_dropout_add,
                            pre_mlp_layernorm=pre_mlp_norm, mlp=mlp, mlp_bda=get_bias_dropout_add))
             for symbol in pattern]
    if num_experts and uses_grouped_mm(expert_gemm, backend):
        specs = [with_grouped_mm_experts(spec) for spec in specs]
    return specs


def final_norm(backend: str):
    return _pieces(backend)["norm"]
