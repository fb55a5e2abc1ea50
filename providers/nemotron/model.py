"""The family's modules as megatron-core specs: RADIO (RADIOViTModel) + projection, and a HybridModel LLM."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.activations import fast_gelu, squared_relu
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.models.mimo.submodules.vision import VisionModalitySubmodules
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.radio import RADIOViTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.spec_utils import ModuleSpec

from mimo import LANGUAGE, Encoder
from mimo.plugins.data import sequence_grids
from mimo.plugins.kit.in_place_loss import InPlaceCrossEntropy
from mimo.plugins.kit.recompute_graphs import RecomputeGraphs
from mimo.plugins.kit.te_extras import te_extras_enabled

from .cpe_jitter import jittered_position_embeddings
from .settings import ENCODER, IMAGES, NemotronVLMSettings
from .specs import hybrid_stack_spec, projection_submodules, resolve_backend, uses_grouped_mm, vit_layer_spec
from .tokens import image_token_id

MAX_SEQLEN_STEP = 256  # RADIO's THD max_seqlen is rounded up to a multiple of this (class tokens included)

# `vision_activation`: C-RADIO's exact GELU, or the tanh approximation of Megatron-LM's RADIO recipe.
VISION_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": fast_gelu}


class NemotronLanguageModel(InPlaceCrossEntropy, HybridModel):
    """megatron-core's HybridModel whose fused loss reuses the logits' buffer for their gradient (kit)."""


def pixel_shuffle(tokens: torch.Tensor, rows: int, cols: int, side: int) -> torch.Tensor:
    """[rows * cols, c] patch features (row-major) -> [(rows/side) * (cols/side), side * side * c].

    Each output token is a side x side block of patches; its channels are ordered (row in block, column in
    block, channel), the order of Megatron-LM's and InternVL's pixel_shuffle (version 2).
    """
    if side == 1:
        return tokens
    c = tokens.shape[-1]
    blocks = tokens.reshape(rows // side, side, cols // side, side, c).permute(0, 2, 1, 3, 4)
    return blocks.reshape((rows // side) * (cols // side), side * side * c)


class RadioEncoder(RADIOViTModel):
    """megatron-core's RADIOViTModel (same parameters, same names) whose output is one row per LLM token:
    the class tokens of each image (tile) dropped, then each image's patch grid pixel-shuffled.

    Fixed tiles: `x [N, 3, H, W]` -> `[N * (H/P) * (W/P) / shuffle, shuffle * hidden]`.
    Dynamic resolution: `x [1, total_patches, 3*P*P]`, `imgs_sizes [N, 2]` (pixels), optional THD
    `packed_seq_params` -> the images' tokens in order. With a video embedder (`temporal_patch_dim` > 1, as
    Nemotron omni checkpoints have), `num_frames` (frames per clip; default one each) groups each clip's frames
    into tubelets of that many (megatron-core's RADIO, mimo.plugins.data.video_clips): a tubelet gives one frame's
    tokens; a one-frame clip is an image, embedded by `embedder`.
    `recompute_graphs`: RecomputeGraphs' options (max_seqlen, ...) to replay the recomputed forward of the
    layers as CUDA graphs (the `vision_graphs` setting), or None.
    """

    def __init__(self, *args, shuffle_side: int = 1, recompute_graphs: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.shuffle_side = shuffle_side
        self.recompute_graphs = RecomputeGraphs(self.decoder, **recompute_graphs) if recompute_graphs else None
        # RADIOViTModel shifts the THD boundaries for its class tokens with an element write (`add_cu[0] = 0`),
        # which on a GPU tensor is a copy from host memory that waits for the GPU: it gets them on the host, and
        # the decoder moves them to the device without a wait
        self.decoder.register_forward_pre_hook(_boundaries_to_device, with_kwargs=True)

    def forward(self, x, attention_mask=None, imgs_sizes=None, packed_seq_params=None, num_frames=None):
        cls = self.class_token_len if self.add_class_token else 0
        x = x.to(self.embedder.weight.dtype)  # pixels arrive in fp32 from a loader that does not know the model
        if not self.dynamic_resolution:
            out = super().forward(x, attention_mask)[:, cls:]  # [N, patches, hidden]
            rows, cols = x.shape[-2] // self.patch_dim, x.shape[-1] // self.patch_dim
            return torch.cat([pixel_shuffle(tile, rows, cols, self.shuffle_side) for tile in out])
        # The sizes stay on the host (the loop leaves imgs_sizes there): read on the GPU, every image's size would
        # be a device-to-host synchronization in each forward.
        sizes = [tuple(size) for size in torch.as_tensor(imgs_sizes).cpu().tolist()]
        frame_grids = [(h // self.patch_dim, w // self.patch_dim) for h, w in sizes]
        # RADIOViTModel shifts the THD boundaries in place for its class tokens: give it a copy it may change, on
        # the host where it shifts them (see __init__)
        packed_seq_params = _packed_params([r * c for r, c in frame_grids], packed_seq_params,
                                           "cpu" if cls else x.device, cls)
        grids = sequence_grids(frame_grids, num_frames, self.temporal_patch_dim)  # one per image or tubelet
        lengths = [r * c for r, c in grids]
        if self.recompute_graphs is not None:  # the decoder's sequences, class tokens included, known here
            self.recompute_graphs.lengths = [n + cls for n in lengths]
        if self.temporal_patch_dim > 1:  # RADIOViTModel then also returns the sizes and frame counts
            frames = list(num_frames) if num_frames is not None else [1] * len(frame_grids)
            out = super().forward(x, attention_mask, torch.tensor(sizes), packed_seq_params, num_frames=frames)[0][0]
        else:
            out = super().forward(x, attention_mask, sizes, packed_seq_params)[0]  # [patches + N * cls, h]
        tokens, start = [], 0
        for (rows, cols), n in zip(grids, lengths):
            tokens.append(pixel_shuffle(out[start + cls:start + cls + n], rows, cols, self.shuffle_side))
            start += cls + n
        return torch.cat(tokens)

    def _get_pos_embeddings(self, batch_size: int, input_dims):
        """Training's jittered position embeddings as two GEMMs (cpe_jitter.py) where RADIOViTModel would sample
        them with grid_sample; everything else as it does."""
        if (self.has_cpe and not self.interpolate_only_cpe and self.training and not self.force_cpe_eval_mode
                and (self.max_num_rows, self.max_num_cols) != tuple(input_dims)):
            return jittered_position_embeddings(self.position_embeddings, self.max_num_rows, self.max_num_cols,
                                                batch_size, tuple(input_dims), self.grid_sample_align_corners)
        return super()._get_pos_embeddings(batch_size, input_dims)


def _boundaries_to_device(decoder, args, kwargs):
    """The decoder's forward pre-hook: THD boundaries left on the host reach the hidden states' device, copied
    from pinned memory without a synchronization."""
    params, hidden = kwargs.get("packed_seq_params"), (args[0] if args else kwargs.get("hidden_states"))
    if params is None or hidden is None or params.cu_seqlens_q.device == hidden.device:
        return None

    def moved(t):
        return t.pin_memory().to(hidden.device, non_blocking=True) if hidden.is_cuda else t.to(hidden.device)

    kwargs["packed_seq_params"] = dataclasses.replace(params, cu_seqlens_q=moved(params.cu_seqlens_q),
                                                      cu_seqlens_kv=moved(params.cu_seqlens_kv))
    return args, kwargs


def _packed_params(lengths: list[int], given: PackedSeqParams | None, device, class_tokens: int = 0) -> PackedSeqParams:
    """A fresh THD PackedSeqParams for images of `lengths` patches (checked against the one given), its boundaries
    copied to `device` without a synchronization. `max_seqlen` is an upper bound rounded so that, with the
    `class_tokens` RADIO adds, it is a multiple of MAX_SEQLEN_STEP: attention kernels (cuDNN's) build an execution
    plan per value, and the longest image of a micro-batch is nearly unique each time."""
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    if given is not None and not torch.equal(given.cu_seqlens_q.cpu().to(torch.int32), cu):
        raise ValueError(f"packed_seq_params.cu_seqlens_q {given.cu_seqlens_q.tolist()} does not match the "
                         f"images' patch counts {lengths}")
    if torch.device(device).type == "cuda":
        cu = cu.pin_memory()
    on_device = cu.to(device, non_blocking=True)
    bound = -(-(max(lengths) + class_tokens) // MAX_SEQLEN_STEP) * MAX_SEQLEN_STEP - class_tokens
    fields = dict(cu_seqlens_q=on_device, cu_seqlens_kv=on_device.clone(), max_seqlen_q=bound, max_seqlen_kv=bound)
    if given is not None:
        return dataclasses.replace(given, **fields)
    return PackedSeqParams(qkv_format="thd", **fields)


# ----------------------------------------------------------------------------------------------------- specs


def vision_spec(s: NemotronVLMSettings, ctx) -> Encoder:
    backend = resolve_backend(s.backend)
    pgc = ctx.pg_collection(IMAGES)
    vit_config = ctx.transformer_config(
        IMAGES, num_layers=s.vision_layers, hidden_size=s.vision_hidden_size, num_attention_heads=s.vision_heads,
        ffn_hidden_size=s.vision_ffn_hidden_size, kv_channels=s.vision_hidden_size // s.vision_heads,
        normalization="LayerNorm", layernorm_epsilon=s.vision_layernorm_epsilon, add_bias_linear=True,
        add_qkv_bias=True, activation_func=VISION_ACTIVATIONS[s.vision_activation], gated_linear_unit=False,
        hidden_dropout=s.dropout, attention_dropout=s.dropout,
        init_method_std=s.init_method_std, **_fused_kernels(backend),
    )
    projection_config = ctx.transformer_config(
        # No attention: the head count only has to suit the encoder grid's TP, like the ViT's.
        IMAGES, num_layers=1, hidden_size=s.hidden_size, ffn_hidden_size=s.projection_hidden_size,
        num_attention_heads=s.vision_heads, add_bias_linear=False, activation_func=squared_relu,
        gated_linear_unit=False, init_method_std=s.init_method_std,
        normalization="RMSNorm", layernorm_epsilon=1e-5,  # read only by projection_norm's fused norm
    )
    encoder = ModuleSpec(module=RadioEncoder, params=dict(
        transformer_config=vit_config, transformer_layer_spec=vit_layer_spec(backend, s.vision_bias_in_gemm),
        add_class_token=s.class_tokens > 0, class_token_len=s.class_tokens, patch_dim=s.patch_size,
        img_h=s.image_size, img_w=s.image_size, max_img_h=s.max_image_size, max_img_w=s.max_image_size,
        has_cpe=True, embedder_bias=False, dynamic_resolution=s.dynamic_resolution,
        # RADIO jitters its position embeddings in training mode unless told not to; never for a frozen encoder.
        force_cpe_eval_mode=not (s.cpe_augmentation and s.trains_vision), shuffle_side=s.shuffle_side,
        temporal_patch_dim=s.video_temporal_patch_size, separate_video_embedder=s.video_temporal_patch_size > 1,
        recompute_graphs=_recompute_graphs(s, ctx, backend), pg_collection=pgc,
    ))
    projection = ModuleSpec(module=MultimodalProjector, params=dict(
        config=projection_config, submodules=projection_submodules(backend, norm=s.has_projection_norm),
        projector_type=s.projection, input_size=s.vision_output_size, pg_collection=pgc,
    ))
    spec = ModuleSpec(module=VisionModalitySubmodules, params={"pg_collection": pgc},
                      submodules={"encoders": {ENCODER: encoder}, "input_projections": [projection]})
    return Encoder(spec=spec, placeholder_token_id=image_token_id(s))


def language_spec(s: NemotronVLMSettings, ctx) -> ModuleSpec:
    backend = resolve_backend(s.backend)
    # A pattern without E layers is a dense LLM: no experts in its config, so TP needs no sequence parallelism.
    num_experts = s.num_experts if "E" in s.hybrid_pattern else None
    if num_experts and ctx.parallelism[LANGUAGE].tp > 1 and not ctx.sequence_parallel:
        raise ValueError("--llm-tp > 1: megatron-core trains MoE layers under tensor parallelism only with "
                         "sequence parallelism: add --sequence-parallel, or use --llm-tp 1 (and --llm-ep to split "
                         "the experts)")
    graphs = _cuda_graph_fields(s, ctx, backend)
    if ctx.fp8 != "none" and backend != "te":
        raise ValueError(f"--fp8 {ctx.fp8} needs backend te: --set backend=te (transformer-engine, mamba-ssm, a GPU)")
    if ctx.sequence_parallel and ctx.parallelism[LANGUAGE].tp > 1 and backend != "te":
        raise ValueError("--sequence-parallel needs backend te (megatron-core's torch norms do not split the "
                         "sequence): --set backend=te, or leave sequence parallelism off")
    _check_context_parallel(s, ctx.parallelism[LANGUAGE], backend)
    config = ctx.transformer_config(
        LANGUAGE, num_layers=s.num_layers, hidden_size=s.hidden_size, num_attention_heads=s.num_attention_heads,
        num_query_groups=s.num_query_groups, kv_channels=s.kv_channels, ffn_hidden_size=s.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=1e-5, add_bias_linear=False, gated_linear_unit=False,
        activation_func=squared_relu, hidden_dropout=s.dropout, attention_dropout=s.dropout,
        init_method_std=s.init_method_std, mamba_num_heads=s.mamba_num_heads, mamba_head_dim=s.mamba_head_dim,
        mamba_num_groups=s.mamba_num_groups, mamba_state_dim=s.mamba_state_dim,
        **(_moe_config(s, backend, fp8=ctx.fp8 != "none") if num_experts else {}),
        **_fused_kernels(backend), **_fused_loss(s, backend), **graphs,
    )
    return ModuleSpec(module=NemotronLanguageModel, params=dict(
        config=config,
        hybrid_stack_spec=hybrid_stack_spec(backend, s.mamba_conv_kernel, s.num_experts, s.mamba_dt_clamp_min,
                                            s.expert_gemm),
        vocab_size=s.vocab_size, max_sequence_length=s.seq_length, hybrid_layer_pattern=s.hybrid_pattern,
        share_embeddings_and_output_weights=False, position_embedding_type="none",
        scatter_embedding_sequence_parallel=False,  # MimoModel scatters the combined embeddings itself
        pre_process=ctx.is_first_stage(LANGUAGE), post_process=ctx.is_last_stage(LANGUAGE),
        pg_collection=ctx.pg_collection(LANGUAGE),
    ))


def _check_context_parallel(s: NemotronVLMSettings, llm, backend: str) -> None:
    """--llm-cp: the Mamba layers split over CP by megatron-core's MambaContextParallel (heads and groups over
    TP x CP, all-to-all with the sequence), which runs on mamba-ssm's kernels: backend te only (as is
    transformer-engine's split of packed --data rows, which the te backend then also has)."""
    if llm.cp == 1:
        return
    if backend != "te":
        raise ValueError(f"--llm-cp {llm.cp} needs backend te: the Mamba layers' context parallelism is "
                         f"megatron-core's MambaContextParallel on mamba-ssm's GPU kernels, which the local backend "
                         f"(and the CPU) lacks; --set backend=te on GPUs, or --llm-cp 1")
    for count, what in ((s.mamba_num_heads, "mamba_num_heads"), (s.num_attention_heads, "num_attention_heads")):
        if count % (llm.tp * llm.cp):
            raise ValueError(f"--llm-cp {llm.cp}: {what} {count} must divide by TP x CP = {llm.tp * llm.cp} "
                             f"(megatron-core splits the heads over both); use a smaller --llm-cp")
    groups = s.mamba_num_groups // llm.tp
    if max(groups, llm.cp) % min(groups, llm.cp):
        raise ValueError(f"--llm-cp {llm.cp}: the Mamba groups per TP rank ({groups}) and CP must divide one "
                         f"another (MambaContextParallel); use a smaller --llm-cp")


def _recompute_graphs(s: NemotronVLMSettings, ctx, backend: str) -> dict | None:
    """RecomputeGraphs' options where the `vision_graphs` setting applies (see its help), else None. Its bound on
    one image's sequence is that of the largest image: one graph per bucket of patch counts, not per image size."""
    if not (s.vision_graphs != "megatron" and ctx.cuda_graphs and backend == "te" and s.dynamic_resolution
            and not s.dropout and ctx.recompute.get(IMAGES) == "full" and ctx.parallelism[IMAGES].tp == 1):
        return None
    longest = s.max_patches + s.class_tokens
    # the backward too, unless DDP's overlapped reduction waits for each parameter's hook (which graphs skip)
    return {"max_seqlen": -(-longest // MAX_SEQLEN_STEP) * MAX_SEQLEN_STEP,
            "backward": s.vision_graphs == "all" and not ctx.overlap_grad_reduce}


def _fused_kernels(backend: str) -> dict:
    """te: megatron-core's fused bias-dropout-add (a jit kernel; the local backend runs on any device)."""
    return {"bias_dropout_fusion": True} if backend == "te" else {}


def _fused_loss(s: NemotronVLMSettings, backend: str) -> dict:
    """te: transformer-engine's fused cross-entropy, which never materializes the fp32 logits (and, through
    NemotronLanguageModel, writes their gradient into them)."""
    if backend == "te" and s.fused_cross_entropy and te_extras_enabled():
        return {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "te"}
    return {}


def _cuda_graph_fields(s: NemotronVLMSettings, ctx, backend: str) -> dict:
    """--cuda-graphs captures the parts of the layers whose shapes are fixed: the Mamba and attention layers, and
    the MoE layers' routers where nothing in them waits for the host (the routed experts' token counts change every
    micro-batch: they stay eager); with FP8 the Mamba layers only, as Megatron-Bridge's FP8 recipe for this model
    does. Packed --data changes every shape: refused."""
    if not ctx.cuda_graphs:
        return {}
    if backend != "te":
        raise ValueError("--cuda-graphs needs backend te: --set backend=te (transformer-engine, mamba-ssm, a GPU)")
    if ctx.llm_input_packed:
        raise ValueError("--cuda-graphs: packed --data gives the LLM sequences of another length every "
                         "micro-batch, which captured graphs cannot replay; add --no-pack-sequences or leave "
                         "--cuda-graphs off")
    wanted = ("mamba",) if ctx.fp8 != "none" else ("mamba", "attn")
    if _routers_graphable(s, ctx, backend):
        # the router only: megatron-core's moe_preprocess scope breaks its shared-expert overlap ("pre_forward_comm
        # must be called from IDLE state" in the second iteration)
        wanted += ("moe_router",)
    return {"cuda_graph_modules": [m for m in wanted if m != "attn" or "*" in s.hybrid_pattern]}


def _routers_graphable(s: NemotronVLMSettings, ctx, backend: str) -> bool:
    """The MoE layers' routers as CUDA graphs: no host wait or collective inside them where the routed experts are
    grouped GEMMs (mimo.plugins.kit.grouped_mm_moe; TP 1, no FP8), with one rank of experts or several. Under
    expert parallelism the dispatcher then waits for the token counts once per layer, so the host no longer runs
    ahead and an eager router's launches leave the GPU idle: on one H200 the slice with megatron-core's waiting
    dispatcher took 44 ms an iteration more with eager routers (scripts/gpu/dispatch_paths.py). megatron-core
    refuses router graphs beside some recompute choices, so the LLM recomputes nothing."""
    language = ctx.parallelism[LANGUAGE]
    return (s.moe_router_graphs and not s.moe_router_force_load_balancing  # random logits: not in a graph
            and uses_grouped_mm(s.expert_gemm, backend) and "E" in s.hybrid_pattern
            and s.num_experts > 1
            and ctx.fp8 == "none" and language.tp == 1 and language.expt_tp == 1
            and ctx.recompute.get(LANGUAGE, "none") == "none")


def _moe_config(s: NemotronVLMSettings, backend: str, fp8: bool = False) -> dict:
    return dict(
        num_moe_experts=s.num_experts, moe_router_topk=s.moe_router_topk, moe_ffn_hidden_size=s.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=s.moe_shared_expert_intermediate_size,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
        moe_router_topk_scaling_factor=s.moe_router_topk_scaling_factor,
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=s.moe_aux_loss_coeff,
        moe_router_force_load_balancing=s.moe_router_force_load_balancing,
        # te: one grouped GEMM for the experts; transformer-engine's fused token permutation and router top-k
        moe_grouped_gemm=backend == "te", moe_permute_fusion=backend == "te",
        # not with FP8: megatron-core pads the routing map in place (pad_routing_map) after transformer-engine's
        # fused router saved it for its backward, which then fails ("modified by an inplace operation")
        moe_router_fusion=backend == "te" and not fp8,
        # FP8 GEMMs need token counts in multiples of 16: pad each expert's routed tokens
        **({"moe_router_padding_for_fp8": True} if fp8 else {}),
        # te: the shared expert runs on a side stream beside the routed experts' dispatch
        moe_shared_expert_overlap=(backend == "te" and s.shared_expert_overlap and te_extras_enabled()
                                   and bool(s.moe_shared_expert_intermediate_size)),
    )
