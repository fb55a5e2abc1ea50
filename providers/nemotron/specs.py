"""Layer specs for both backends.

`te` uses megatron-core's own transformer-engine specs (the hybrid stack of `hybrid_layer_specs`, the ViT layer of
`vit_layer_specs`). `local` is the same architecture from megatron-core's local pieces: each TE module is replaced
by the local module in `TE_TO_LOCAL`, and nothing else changes (tests walk both specs side by side to check it).
Parameter names are therefore equal in both backends except inside the routed experts (see README.md).
Both build their MoE layers with the kit's per-sample sequence-level auxiliary loss
(`mimo.plugins.kit.packed_seq_aux_loss`): a packed micro-batch balances each sample, as if it were alone; unpacked
rows are megatron-core's own.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from functools import partial

import torch
from megatron.core.extensions import transformer_engine as te
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer, TransformerLayer, TransformerLayerSubmodules,
)

from mimo.plugins import SDPAttention
from mimo.plugins.kit.grouped_mm_moe import uses_grouped_mm, with_grouped_mm_experts
from mimo.plugins.kit.linear_bias import with_biases_in_gemm
from mimo.plugins.kit.packed_seq_aux_loss import with_per_sample_seq_aux_loss
from .layers import LayerNormColumnParallelLinear, LocalHybridStack
from .mamba_mixer import LocalMambaMixer, MambaMixerSubmodules

# Each TE (or kernel-backed) module and its local counterpart, with identical parameters and names. The routed
# experts are the one structural difference: TEGroupedMLP (one grouped GEMM) against megatron's SequentialMLP
# (one MLP per expert); their distributed-checkpoint keys are the same (megatron-core makes them so).
TE_TO_LOCAL = {
    te.TELayerNormColumnParallelLinear: LayerNormColumnParallelLinear,
    te.TEColumnParallelLinear: ColumnParallelLinear,
    te.TERowParallelLinear: RowParallelLinear,
    te.TEDotProductAttention: SDPAttention,
    te.TENorm: WrappedTorchNorm,
    MambaMixer: LocalMambaMixer,
    HybridStack: LocalHybridStack,
}


def te_available() -> bool:
    """transformer-engine and mamba-ssm both import, and a GPU is visible (their kernels need one)."""
    from megatron.core.ssm import mamba_mixer

    return te.HAVE_TE and mamba_mixer.HAVE_MAMBA_SSM and torch.cuda.is_available()


def resolve_backend(requested: str) -> str:
    if requested == "auto":
        return "te" if te_available() else "local"
    if requested == "te" and not te_available():
        missing = [name for name, ok in (("transformer-engine", te.HAVE_TE),
                                         ("mamba-ssm", importlib.util.find_spec("mamba_ssm") is not None),
                                         ("a visible GPU", torch.cuda.is_available())) if not ok]
        # ValueError: mimo says it in one line (a checkpoint trained with te, read on a machine without it)
        raise ValueError(f"backend 'te' needs {', '.join(missing) or 'transformer-engine and mamba-ssm'}; "
                         f"use backend=local (or auto)")
    return requested


# --------------------------------------------------------------------------------------------- language model


def _te_hybrid_stack(conv_kernel: int, grouped_mm: bool) -> ModuleSpec:
    """megatron-core's TE hybrid stack with only the layer kinds this family uses (M, E, *, -); `grouped_mm`: the
    routed experts as torch grouped GEMMs (mimo.plugins.kit.grouped_mm_moe)."""
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    sub = hybrid_stack_spec.submodules
    moe = with_per_sample_seq_aux_loss(with_grouped_mm_experts(sub.moe_layer) if grouped_mm else sub.moe_layer)
    mixer = sub.mamba_layer.submodules.mixer  # copied, not changed: the spec is megatron-core's module global
    mixer = dataclasses.replace(mixer, params={**mixer.params, "d_conv": conv_kernel})
    mamba = dataclasses.replace(sub.mamba_layer, submodules=dataclasses.replace(sub.mamba_layer.submodules,
                                                                                mixer=mixer))
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        mamba_layer=mamba, attention_layer=sub.attention_layer, moe_layer=moe, mlp_layer=sub.mlp_layer))


def _local_hybrid_stack(conv_kernel: int, num_experts: int, dt_clamp_min: float = 0.0,
                        grouped_mm: bool = False) -> ModuleSpec:
    """The same stack from local modules: the norms fused into the first linear of each layer kind, like TE's.
    `dt_clamp_min` > 0 bounds the Mamba step size from below (Hugging Face's NemotronH does), which only the local
    mixer can; at 0 the spec is exactly the TE one."""
    mixer_params = {"d_conv": conv_kernel}
    if dt_clamp_min > 0:
        mixer_params["dt_limit"] = (dt_clamp_min, float("inf"))
    mamba = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        mixer=ModuleSpec(module=LocalMambaMixer, params=mixer_params, submodules=MambaMixerSubmodules(
            in_proj=LayerNormColumnParallelLinear, out_proj=RowParallelLinear)),
        mamba_bda=get_bias_dropout_add))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        self_attention=ModuleSpec(
            module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(linear_qkv=LayerNormColumnParallelLinear,
                                               core_attention=SDPAttention, linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add))
    moe = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=WrappedTorchNorm,
        mlp=get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False),
        mlp_bda=get_bias_dropout_add))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(
            linear_fc1=LayerNormColumnParallelLinear, linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add))
    if grouped_mm:
        moe = with_grouped_mm_experts(moe)
    moe = with_per_sample_seq_aux_loss(moe)
    return ModuleSpec(module=LocalHybridStack, submodules=HybridStackSubmodules(
        mamba_layer=mamba, attention_layer=attention, moe_layer=moe, mlp_layer=mlp))


def hybrid_stack_spec(backend: str, conv_kernel: int, num_experts: int, dt_clamp_min: float = 0.0,
                      expert_gemm: str = "megatron") -> ModuleSpec:
    grouped_mm = uses_grouped_mm(expert_gemm, backend)
    if backend != "te":
        return _local_hybrid_stack(conv_kernel, num_experts, dt_clamp_min, grouped_mm)
    if dt_clamp_min > 0:  # MambaMixer calls the mamba-ssm kernels with a fixed dt_limit of (0, inf)
        raise ValueError(f"mamba_dt_clamp_min {dt_clamp_min}: megatron-core's MambaMixer (backend te) does not "
                         f"clamp the Mamba step size; use backend=local or mamba_dt_clamp_min=0")
    return _te_hybrid_stack(conv_kernel, grouped_mm)


# --------------------------------------------------------------------------------------------- vision encoder


def vit_layer_spec(backend: str, bias_in_gemm: bool = False) -> ModuleSpec:
    """A pre-norm ViT layer without a causal mask; te is megatron-core's own TE ViT layer. `bias_in_gemm`: the
    attention output projection and the MLP's linears add their biases themselves (kit linear_bias)."""
    spec = _vit_layer_spec(backend)
    return with_biases_in_gemm(spec) if bias_in_gemm else spec


def _vit_layer_spec(backend: str) -> ModuleSpec:
    if backend == "te":
        from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_transformer_engine_spec

        return get_vit_layer_with_transformer_engine_spec()
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        self_attention=ModuleSpec(
            module=SelfAttention, params={"attn_mask_type": AttnMaskType.no_mask},
            submodules=SelfAttentionSubmodules(linear_qkv=LayerNormColumnParallelLinear,
                                               core_attention=SDPAttention, linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=IdentityOp,
        mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(
            linear_fc1=LayerNormColumnParallelLinear, linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add))


def projection_submodules(backend: str, norm: bool = False) -> MLPSubmodules:
    """fc1 and fc2 of the projection. fc1 is megatron's ColumnParallelLinear in both backends: the affine
    projection builds it with gather_output=True, which TE's linear layers refuse. With `norm` (mlp projection
    only) fc1 has the config's norm fused in front, as the Nemotron Nano VL / omni projector's RMSNorm."""
    if norm:
        fc1 = te.TELayerNormColumnParallelLinear if backend == "te" else LayerNormColumnParallelLinear
    else:
        fc1 = ColumnParallelLinear
    return MLPSubmodules(linear_fc1=fc1, linear_fc2=te.TERowParallelLinear if backend == "te" else RowParallelLinear)
