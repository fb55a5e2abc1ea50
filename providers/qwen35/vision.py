"""The Qwen3.5-VL vision tower on megatron-core: transformers' `Qwen3_5VisionModel` as a tower (patch embedding,
learned position grid, megatron-core TransformerBlock) and its patch merger (the modality's input projection).

* Patch embedding: transformers' Conv3d with kernel = stride = (T, P, P) is one linear map of each patch row
  `(c, t, y, x)` (image_grid.py's layout); the weight keeps the Conv3d's shape `[h, C, T, P, P]`.
* Position embedding: a learned `side x side` grid (`vision_position_embeddings = side^2`) resampled to each image's
  patch grid bilinearly (align_corners), added to the patch embeddings.
* Blocks: megatron-core TransformerLayers (LayerNorm, fused-qkv self-attention with biases, MLP with a GELU) whose
  attention stays within each image: the images of a micro-batch are one packed THD sequence, megatron-core's
  attention gets its boundaries and the kit's SDPAttention attends per image (any device, CPU included).
* 2-D rotary embedding: each head's channels rotate by the patch's row (first and third quarters of the channels)
  and column (second and fourth), with `head_dim / 4` frequencies: one frequency row per packed token, which
  megatron-core applies with each image's offset into the packed sequence.
* Patch merger: LayerNorm over each patch, each `m x m` block of patches (consecutive rows: image_grid.py's
  merge-block order) concatenated, then fc1, exact GELU, fc2 to the LLM's hidden size: megatron-core's
  MultimodalProjector with the norm in front.

The tower's parameters keep megatron-core's names (`decoder.layers.*`); hf/vision.py maps transformers' onto them.
The LLM's 3-D positions need each image's grid of merged tokens: `image_grid.llm_grid_thw(grid_thw, merge)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.mimo.submodules.vision import VisionModalitySubmodules
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from mimo.plugins import SDPAttention, setting

from .image_grid import QWEN_MAX_PIXELS, QWEN_MEAN, QWEN_MIN_PIXELS, QWEN_STD, GridImages

LAYERNORM_EPSILON = 1e-6  # transformers' Qwen3.5 vision LayerNorms (blocks and merger), not configurable there


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' `gelu_pytorch_tanh`."""
    return F.gelu(x, approximate="tanh")


VISION_ACTIVATIONS = {"gelu_tanh": gelu_tanh, "gelu": F.gelu}


@dataclass
class Qwen35VisionSettings:
    """The vision tower's and its images' settings (defaults: transformers' Qwen3.5 vision config and the Qwen
    processor's). The provider's settings inherit these fields; a subclass's `__post_init__` calls this one's."""

    vision_depth: int = setting(27, "transformer blocks of the vision tower", minimum=1)
    vision_hidden_size: int = setting(1152, "hidden size of the vision tower", minimum=1)
    vision_intermediate_size: int = setting(4304, "MLP size of the vision tower's blocks", minimum=1)
    vision_heads: int = setting(16, "attention heads of the vision tower", minimum=1, divides="vision_hidden_size")
    vision_activation: Literal["gelu_tanh", "gelu"] = setting(
        "gelu_tanh", "MLP activation of the vision blocks: gelu_tanh (transformers' gelu_pytorch_tanh, Qwen's) or "
                     "gelu (exact)")
    vision_position_embeddings: int = setting(
        2304, "learned position embeddings of the vision tower: a square grid (2304 = 48 x 48) resampled to each "
              "image's patch grid", minimum=1)
    vision_rope_theta: float = setting(10000.0, "base of the vision tower's 2-D rotary embedding", minimum=1.0)
    vision_out_hidden_size: int | None = setting(
        None, "output size of the patch merger, the LLM's hidden size (default: the settings' hidden_size)",
        minimum=1)
    patch_size: int = setting(16, "vision patch size in pixels", minimum=1)
    temporal_patch_size: int = setting(2, "frames in one patch (an image is repeated over them)", minimum=1)
    spatial_merge_size: int = setting(
        2, "the patch merger joins each square of this many patches per side into one LLM token", minimum=1)
    min_pixels: int = setting(QWEN_MIN_PIXELS, "images smaller than this many pixels are enlarged (keeping "
                                               "their aspect ratio)", minimum=1)
    max_pixels: int = setting(QWEN_MAX_PIXELS, "images larger than this many pixels are shrunk (keeping their "
                                               "aspect ratio)", minimum=1)
    image_mean: tuple[float, ...] = setting(QWEN_MEAN, "per-channel mean the image pixels (in [0, 1]) are "
                                                       "normalized with")
    image_std: tuple[float, ...] = setting(QWEN_STD, "per-channel standard deviation of that normalization")

    def __post_init__(self):
        head_dim = self.vision_hidden_size // self.vision_heads
        if head_dim % 4:
            raise ValueError(f"vision_hidden_size / vision_heads = {head_dim}: the 2-D rotary embedding needs a "
                             f"head size that is a multiple of 4")
        if math.isqrt(self.vision_position_embeddings) ** 2 != self.vision_position_embeddings:
            raise ValueError(f"vision_position_embeddings {self.vision_position_embeddings} is no square grid "
                             f"(48 * 48 = 2304, ...)")
        llm = getattr(self, "hidden_size", None)  # the provider's settings, which inherit these
        if self.vision_out_hidden_size is None and llm is None:
            raise ValueError("vision_out_hidden_size: give the patch merger's output size (the LLM's hidden size)")
        if None not in (self.vision_out_hidden_size, llm) and self.vision_out_hidden_size != llm:
            raise ValueError(f"vision_out_hidden_size {self.vision_out_hidden_size} differs from hidden_size {llm}: "
                             f"the merged image tokens are the LLM's inputs")
        self.image_mean, self.image_std = tuple(self.image_mean), tuple(self.image_std)
        self.image_mode()  # the image settings' own checks

    @property
    def vision_output_size(self) -> int:
        """The patch merger's output size: vision_out_hidden_size, else the LLM's hidden_size."""
        return self.vision_out_hidden_size or self.hidden_size

    def image_mode(self) -> GridImages:
        """The data path's image mode for these settings."""
        return GridImages(patch_size=self.patch_size, merge_size=self.spatial_merge_size,
                          temporal_patch_size=self.temporal_patch_size, min_pixels=self.min_pixels,
                          max_pixels=self.max_pixels, mean=self.image_mean, std=self.image_std)


# --------------------------------------------------------------------------------------------------- the tower


class PatchEmbedding(torch.nn.Module):
    """transformers' Conv3d patch embedding as the linear map it is: `[patches, C*T*P*P] -> [patches, h]`."""

    def __init__(self, hidden: int, channels: int, temporal: int, patch: int, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(hidden, channels, temporal, patch, patch, device=device,
                                                     dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden, device=device, dtype=dtype))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.weight.flatten(1), self.bias)


@dataclass
class PackedGrids:
    """What the tower needs of a micro-batch's `grid_thw`, made on the host once per forward."""

    cu_seqlens: torch.Tensor  # int32 [frames + 1]: each frame of each image is one attention sequence
    max_seqlen: int
    rows: torch.Tensor  # long [patches]: each patch's row in its frame, in merge-block order
    cols: torch.Tensor  # long [patches]: its column


def packed_grids(grids: list[tuple[int, int, int]], merge: int) -> PackedGrids:
    lengths, rows, cols = [], [], []
    for t, h, w in grids:
        if h % merge or w % merge:
            raise ValueError(f"grid {h}x{w} patches is not a multiple of spatial_merge_size {merge} per side")
        r = torch.arange(h).view(h, 1).expand(h, w)
        c = torch.arange(w).view(1, w).expand(h, w)
        for axis, out in ((r, rows), (c, cols)):  # merge-block order: block row, block column, row, column
            out.append(axis.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten().repeat(t))
        lengths += [h * w] * t
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    return PackedGrids(cu, max(lengths), torch.cat(rows), torch.cat(cols))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the GPU (a copy from pageable memory would)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def position_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two taps into a `side`-long table, and their weights, of positions `index` on axes of `size`:
    bilinear with the corners aligned (transformers' closed form, computed the same way in fp32)."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class Qwen35VisionTower(MegatronModule):
    """Patches of packed images -> one hidden state per patch (merge-block order), before the patch merger.

    forward(pixel_values [patches, C*T*P*P], grid_thw [images, 3]) -> [patches, hidden]. `grid_thw` is read on
    the host (a GPU tensor costs one wait per forward)."""

    def __init__(self, config, transformer_layer_spec: ModuleSpec, *, patch_size: int, temporal_patch_size: int,
                 spatial_merge_size: int, position_embeddings: int, rope_theta: float, pg_collection,
                 in_channels: int = 3):
        super().__init__(config=config)
        self.tp_group = pg_collection.tp  # read by MegatronModule.sharded_state_dict (no global parallel_state)
        self.merge = spatial_merge_size
        self.side = math.isqrt(position_embeddings)
        head_dim = config.hidden_size // config.num_attention_heads
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        dtype = config.params_dtype
        self.patch_embed = PatchEmbedding(config.hidden_size, in_channels, temporal_patch_size, patch_size,
                                          device=device, dtype=dtype)
        self.pos_embed = torch.nn.Embedding(position_embeddings, config.hidden_size, device=device, dtype=dtype)
        with torch.no_grad():
            config.init_method(self.patch_embed.weight)
            config.init_method(self.pos_embed.weight)
        quarter = head_dim // 2
        # fp32 on the host, no buffer: a bf16 run's module cast would round the frequencies
        self.inv_freq = 1.0 / rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter)
        self.decoder = TransformerBlock(config=config, spec=transformer_layer_spec, post_layer_norm=False,
                                        pg_collection=pg_collection)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = [tuple(int(v) for v in g) for g in torch.as_tensor(grid_thw).cpu().tolist()]
        packed = packed_grids(grids, self.merge)
        if packed.rows.numel() != pixel_values.shape[0]:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patch rows, grid_thw {grids} gives "
                             f"{packed.rows.numel()}")
        device = pixel_values.device
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        x = x + self._position_embeddings(grids, packed, device).to(x.dtype)
        # THD boundaries stay on the host: SDPAttention and megatron-core's packed RoPE read them there
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens, cu_seqlens_kv=packed.cu_seqlens,
                                 max_seqlen_q=packed.max_seqlen, max_seqlen_kv=packed.max_seqlen)
        out = self.decoder(x[:, None], attention_mask=None, rotary_pos_emb=self._rotary(packed, device),
                           packed_seq_params=params)
        return out[:, 0]

    def _position_embeddings(self, grids, packed: PackedGrids, device) -> torch.Tensor:
        """The learned grid resampled to every patch: 4 weighted rows of `pos_embed` each, in fp32."""
        grid = torch.tensor(grids).view(-1, 3)
        sizes = grid[:, 1:].repeat_interleave(grid.prod(-1), dim=0)  # each patch's (grid_h, grid_w)
        h_taps, h_weights = position_taps(packed.rows, sizes[:, 0], self.side)
        w_taps, w_weights = position_taps(packed.cols, sizes[:, 1], self.side)
        index = to_device((h_taps[:, :, None] * self.side + w_taps[:, None, :]).flatten(1), device)
        weights = to_device((h_weights[:, :, None] * w_weights[:, None, :]).flatten(1), device)
        return (self.pos_embed(index).float() * weights[:, :, None]).sum(1)

    def _rotary(self, packed: PackedGrids, device) -> torch.Tensor:
        """[patches, 1, 1, head_dim] angles: (row, column, row, column) frequencies, one row per packed token
        (megatron-core then rotates each image's tokens by their own rows)."""
        inv = to_device(self.inv_freq, device)
        rows = to_device(packed.rows, device).float()[:, None] * inv
        cols = to_device(packed.cols, device).float()[:, None] * inv
        return torch.cat([rows, cols, rows, cols], dim=-1)[:, None, None, :]


class Qwen35PatchMerger(MultimodalProjector):
    """[patches, vision hidden] (merge-block order) -> [patches / m^2, LLM hidden]: LayerNorm per patch, each m x m
    block's patches side by side, then megatron-core's MLP projector (fc1, GELU, fc2)."""

    def __init__(self, config, submodules: MLPSubmodules, *, vision_hidden_size: int, merge_size: int,
                 pg_collection):
        super().__init__(config, submodules, projector_type="mlp", input_size=vision_hidden_size * merge_size ** 2,
                         pg_collection=pg_collection)
        self.merged_size = vision_hidden_size * merge_size ** 2
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.norm = torch.nn.LayerNorm(vision_hidden_size, eps=config.layernorm_epsilon, device=device,
                                       dtype=config.params_dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.shape[0] * hidden_states.shape[-1] % self.merged_size:
            raise ValueError(f"{hidden_states.shape[0]} patches do not make whole merged tokens of "
                             f"{self.merged_size // hidden_states.shape[-1]}")
        return super().forward(self.norm(hidden_states).reshape(-1, self.merged_size))


# ------------------------------------------------------------------------------------------------------- specs


def vision_layer_spec() -> ModuleSpec:
    """A pre-norm block without a mask from megatron-core's local modules and the kit's SDPAttention (THD)."""
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm,
        self_attention=ModuleSpec(
            module=SelfAttention, params={"attn_mask_type": AttnMaskType.no_mask},
            submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=SDPAttention,
                                               linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=WrappedTorchNorm,
        mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                  linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add))


def tower_spec(s: Qwen35VisionSettings, ctx, module: str, init_method_std: float = 0.02,
               dropout: float = 0.0) -> ModuleSpec:
    """The tower for settings `s` on the grid of `module` (the modality) of a BuildContext `ctx`."""
    config = ctx.transformer_config(
        module, num_layers=s.vision_depth, hidden_size=s.vision_hidden_size, num_attention_heads=s.vision_heads,
        num_query_groups=s.vision_heads, kv_channels=s.vision_hidden_size // s.vision_heads,
        ffn_hidden_size=s.vision_intermediate_size, normalization="LayerNorm", layernorm_epsilon=LAYERNORM_EPSILON,
        add_bias_linear=True, add_qkv_bias=True, activation_func=VISION_ACTIVATIONS[s.vision_activation],
        gated_linear_unit=False, bias_activation_fusion=False, apply_rope_fusion=False,
        hidden_dropout=dropout, attention_dropout=dropout, init_method_std=init_method_std)
    return ModuleSpec(module=Qwen35VisionTower, params=dict(
        config=config, transformer_layer_spec=vision_layer_spec(), patch_size=s.patch_size,
        temporal_patch_size=s.temporal_patch_size, spatial_merge_size=s.spatial_merge_size,
        position_embeddings=s.vision_position_embeddings, rope_theta=s.vision_rope_theta,
        pg_collection=ctx.pg_collection(module)))


def merger_spec(s: Qwen35VisionSettings, ctx, module: str, init_method_std: float = 0.02) -> ModuleSpec:
    merged = s.vision_hidden_size * s.spatial_merge_size ** 2
    config = ctx.transformer_config(
        # No attention: the head count only has to suit the encoder grid's TP, like the tower's.
        module, num_layers=1, hidden_size=s.vision_output_size, ffn_hidden_size=merged,
        num_attention_heads=s.vision_heads, add_bias_linear=True, activation_func=F.gelu, gated_linear_unit=False,
        bias_activation_fusion=False, normalization="LayerNorm", layernorm_epsilon=LAYERNORM_EPSILON,
        init_method_std=init_method_std)
    return ModuleSpec(module=Qwen35PatchMerger, params=dict(
        config=config, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        vision_hidden_size=s.vision_hidden_size, merge_size=s.spatial_merge_size,
        pg_collection=ctx.pg_collection(module)))


def vision_submodules_spec(s: Qwen35VisionSettings, ctx, module: str, encoder: str, init_method_std: float = 0.02,
                           dropout: float = 0.0) -> ModuleSpec:
    """The modality's submodules: the tower as encoder `encoder`, the patch merger as its input projection (its
    output, one row per LLM placeholder, goes to the LLM)."""
    return ModuleSpec(module=VisionModalitySubmodules, params={"pg_collection": ctx.pg_collection(module)},
                      submodules={"encoders": {encoder: tower_spec(s, ctx, module, init_method_std, dropout)},
                                  "input_projections": [merger_spec(s, ctx, module, init_method_std)]})
