"""The settings of the Nemotron MoE VLM family: one dataclass; the variants differ only in defaults (see
`VARIANTS` in `__init__.py`). The defaults are the 20-layer model's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

IMAGES = "images"  # the modality, also the encoder grid's module name
ENCODER = "radio"  # the encoder's name inside the modality: modality_submodules.images.encoders.radio
LAYER_SYMBOLS = {"M": "Mamba", "E": "MoE", "*": "attention", "-": "MLP"}

# C-RADIO normalizes pixels in [0, 1] with OpenAI CLIP's statistics.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

PATTERN_20L = "MEMEM*EMEMEM*EMEMEM*"
PATTERN_54L = "MEMEM*EMEM*EMEM*EMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEME"
# The released Nemotron 3 Nano 30B-A3B (and the LLM of its omni VLM): 23 Mamba, 23 MoE, 6 attention layers.
PATTERN_52L = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def _setting(default, help: str, **rules):
    """A setting with its help and declared rules (mimo.plugins.constraints: checked before __post_init__)."""
    return field(default=default, metadata={"help": help, **rules})


SIZE = {"minimum": 1}  # a size or count: 0 and negative values are refused
FRACTION = {"minimum": 0.0, "maximum": 1.0}


@dataclass
class NemotronVLMSettings:
    # -- what trains, and with which kernels
    stage: Literal["stage1", "stage2", "stage3"] = _setting(
        "stage3", "stage1: train the projection only; stage2: freeze the vision encoder; stage3: train all")
    backend: Literal["auto", "te", "local"] = _setting(
        "auto", "te: transformer-engine + mamba-ssm kernels; local: plain megatron-core/PyTorch modules (any "
        "device); auto: te when both are installed and a GPU is visible")
    fused_cross_entropy: bool = _setting(
        True, "backend te: transformer-engine's fused cross-entropy (no fp32 copy of the logits)")
    shared_expert_overlap: bool = _setting(
        True, "backend te: run the shared expert on a side stream, overlapping the routed experts' dispatch")
    expert_gemm: Literal["auto", "grouped_mm", "megatron"] = _setting(
        "auto", "routed experts: grouped_mm runs them as two torch grouped GEMMs with the token counts on the GPU "
        "(no host sync; one rank of experts, bf16/fp32, no FP8); megatron: megatron-core's experts (backend te: "
        "transformer-engine's grouped GEMM; local: one MLP per expert); auto: grouped_mm with backend te where "
        "it applies")

    moe_router_force_load_balancing: bool = _setting(
        False, "benchmarks only, not for training: route by random logits (megatron-core's "
               "moe_router_force_load_balancing), so each expert gets its share of tokens whatever the weights; "
               "measures a layout without the routing imbalance of untrained weights")
    moe_router_graphs: bool = _setting(
        True, "with --cuda-graphs: capture each MoE layer's router too (megatron-core's moe_router scope) where "
              "nothing there waits for the host: the routed experts as grouped GEMMs (expert_gemm), LLM TP 1 and "
              "expert TP 1, no FP8, no LLM recompute")

    # -- vision encoder (RADIO ViT)
    vision_layers: int = _setting(32, "transformer layers of the RADIO encoder", **SIZE)
    vision_hidden_size: int = _setting(1280, "hidden size of the RADIO encoder", **SIZE)
    vision_heads: int = _setting(16, "attention heads of the RADIO encoder", **SIZE, divides="vision_hidden_size")
    vision_ffn_hidden_size: int = _setting(5120, "MLP size of the RADIO encoder", **SIZE)
    patch_size: int = _setting(16, "ViT patch size in pixels", **SIZE)
    class_tokens: int = _setting(8, "class and register tokens RADIO prepends per image (tile); all dropped after "
                                    "the encoder; 0: none", minimum=0)
    vision_layernorm_epsilon: float = _setting(1e-6, "epsilon of the RADIO encoder's LayerNorms", minimum=0.0)
    vision_graphs: Literal["all", "forward", "megatron"] = _setting(
        "forward", "with --cuda-graphs, backend te and the encoder recomputed in full (--recompute images=full, or "
                   "chosen by --encoder-pass auto): RADIO's no-grad forward replays a CUDA graph per bucket of packed "
                   "patch counts (its Python launches otherwise leave the GPU waiting); all: each layer's recompute "
                   "and backward too (not with --overlap-grad-reduce); megatron: megatron-core's recompute")
    vision_bias_in_gemm: bool = _setting(
        True, "RADIO's attention output projection and MLP linears add their biases inside the GEMM (with backend "
               "te, transformer-engine's epilogue; its backward GEMM gives the bias gradient) instead of returning "
               "them for megatron-core's separate broadcast adds")
    vision_activation: Literal["gelu", "gelu_tanh"] = _setting(
        "gelu", "MLP activation of the RADIO encoder: gelu (exact, erf; C-RADIO's) or gelu_tanh (tanh "
                "approximation: Megatron-LM's fast_gelu)")
    image_mean: tuple[float, ...] = _setting(CLIP_MEAN, "per-channel (RGB) mean the data path subtracts from pixels "
                                                        "in [0, 1] (C-RADIO's input conditioner: OpenAI CLIP's)")
    image_std: tuple[float, ...] = _setting(CLIP_STD, "per-channel (RGB) standard deviation the data path divides "
                                                      "pixels by, after the mean")
    video_temporal_patch_size: int = _setting(
        1, "frames per patch of RADIO's separate video patch embedder, which Nemotron omni checkpoints hold (dynamic "
           "resolution; only the synthetic data's video_frames feed it, --data gives images); 1: no video embedder",
        **SIZE)
    max_image_size: int = _setting(2048, "side in pixels of RADIO's position-embedding grid (CPE)", **SIZE)
    cpe_augmentation: bool = _setting(True, "jitter RADIO's position embeddings (CPE) while the encoder trains, "
                                            "as RADIOViTModel does in training mode; never while it is frozen")
    dynamic_resolution: bool = _setting(True, "images keep their aspect ratio, packed into one THD sequence; "
                                              "false: every image is one image_size x image_size tile")
    image_size: int = _setting(512, "tile side in pixels (without dynamic resolution)", **SIZE)
    min_patches: int = _setting(256, "dynamic resolution: fewest patches per image", **SIZE)
    max_patches: int = _setting(4096, "dynamic resolution: most patches per image", **SIZE)
    image_grid: Literal["scaled", "closest"] = _setting(
        "scaled", "dynamic resolution: each image's patch grid; scaled: the omni processor's rule and bicubic resize "
                  "(what an exported model sees); closest: the grid closest to the image's aspect ratio, bilinear "
                  "(runs before the processor's rule was adopted)")
    pixel_shuffle: bool = _setting(True, "merge each 2x2 block of patch features into one token (4x fewer)")
    # The released omni model's projector (and the only form export-hf can write); Megatron-LM's recipe trains
    # affine, without a norm: --set projection=affine.
    projection: Literal["mlp", "affine"] = _setting(
        "mlp", "vision-to-LLM projection: an MLP (squared ReLU; the released omni model's), or one linear layer "
               "(Megatron-LM's recipe; not exportable to Hugging Face); no biases")
    projection_hidden_size: int = _setting(20480, "hidden size of the mlp projection (4 x its input)", **SIZE)
    projection_norm: bool = _setting(True, "RMSNorm (eps 1e-5) on the mlp projection's input, as in the "
                                           "Nemotron Nano VL / omni projector; the affine projection has none")

    # -- language model (hybrid Mamba / MoE / attention)
    hybrid_pattern: str = _setting(PATTERN_20L, "one symbol per layer: M Mamba, E MoE, * attention, - dense MLP")
    hidden_size: int = _setting(2688, "hidden size of the language model", **SIZE)
    num_attention_heads: int = _setting(32, "query heads of the attention layers", **SIZE)
    num_query_groups: int = _setting(8, "key/value heads of the attention layers (grouped-query attention)", **SIZE,
                                     divides="num_attention_heads")
    kv_channels: int = _setting(128, "head dimension of the attention layers", **SIZE)
    num_experts: int = _setting(128, "routed experts per MoE layer", **SIZE)
    moe_router_topk: int = _setting(6, "experts each token is routed to", **SIZE)
    moe_ffn_hidden_size: int = _setting(1856, "hidden size of each routed expert", **SIZE)
    ffn_hidden_size: int = _setting(10752, "hidden size of the dense MLP layers (-; squared ReLU, no gate)", **SIZE)
    moe_shared_expert_intermediate_size: int = _setting(3712, "hidden size of the shared expert", **SIZE)
    moe_router_topk_scaling_factor: float = _setting(2.5, "scale of the (normalized sigmoid) routing weights")
    moe_aux_loss_coeff: float = _setting(1e-4, "coefficient of the per-sequence load-balancing loss", minimum=0.0)
    mamba_num_heads: int = _setting(64, "Mamba-2 heads", **SIZE)
    mamba_head_dim: int = _setting(64, "Mamba-2 head dimension", **SIZE)
    mamba_num_groups: int = _setting(8, "Mamba-2 groups (B/C projections shared by heads of a group)", **SIZE,
                                     divides="mamba_num_heads")
    mamba_state_dim: int = _setting(128, "Mamba-2 state size", **SIZE)
    mamba_conv_kernel: int = _setting(4, "Mamba-2 causal convolution width", **SIZE)
    mamba_dt_clamp_min: float = _setting(
        0.0, "lower bound of the Mamba-2 step size dt (after softplus) in the forward pass; 0: none, as in "
             "megatron-core's MambaMixer; Hugging Face's NemotronH clamps at its time_step_min (local backend only)",
        minimum=0.0)
    vocab_size: int = _setting(131072, "vocabulary size (embedding and output layer, untied)", **SIZE)
    seq_length: int = _setting(8192, "tokens per sample, image tokens included", **SIZE)
    init_method_std: float = _setting(0.0173, "standard deviation of the initial weights (all modules)", minimum=0.0)

    # -- tokens and data
    tokenizer_path: str | None = _setting(
        None, "local Hugging Face tokenizer folder (tokenizer.json and tokenizer_config.json naming eos_token; "
              "vocab_size must hold its ids): tokenizes --data (default: UTF-8 bytes, which needs vocab_size >= 264) "
              "and gives the image token and the synthetic captions' tokens")
    chat_template: Literal["auto", "tokenizer", "nemotron", "plain"] = _setting(
        "auto", "--data: prompt format (auto: the tokenizer_path folder's own Jinja chat template where it has one, "
                "else nemotron; tokenizer: that folder's template, which needs transformers (the hf extra); "
                "nemotron: the Nemotron VL models' ChatML turns and <img> tags; plain: no turn markers)")
    shuffle_buffer: int = _setting(100, "--data: energon's sample shuffle buffer (0: none; shards still shuffle)",
                                   minimum=0)
    image_token_id: int | None = _setting(None, "image placeholder token (default: the tokenizer's <image>, "
                                                "else vocab_size - 1)", minimum=0)
    image_probability: float = _setting(1.0, "synthetic data: fraction of samples with media (their images and "
                                              "video); the others are text only", **FRACTION)
    # What the encoder's share of the work is (docs/benchmarks.md): documents carry several images, videos frames.
    images_per_sample: int = _setting(1, "synthetic data: images a sample with media carries, their placeholders "
                                         "first (documents: several); 0: only the video (video_frames)", minimum=0)
    video_frames: int = _setting(
        0, "synthetic data: frames of one video clip a sample with media carries after its images, all of one size "
           "drawn as an image's; RADIO encodes each group of video_temporal_patch_size frames as one sequence of "
           "one frame's patches (1: every frame alone); 0: no video", minimum=0)
    patches_per_image: int = _setting(
        0, "synthetic data, dynamic resolution: every image and video frame exactly this many patches, on the grid "
           "nearest a square whose sides are multiples of the pixel-shuffle side; within [min_patches, max_patches]; "
           "0: a random aspect ratio in [1/2, 2] and a patch count log-uniform in [min_patches, max_patches]",
        minimum=0)
    num_classes: int = _setting(16, "synthetic data: image classes, each with its own caption", **SIZE)
    dropout: float = _setting(0.0, "hidden and attention dropout of both models", **FRACTION)

    def __post_init__(self):
        bad = sorted(set(self.hybrid_pattern) - set(LAYER_SYMBOLS))
        if not self.hybrid_pattern or bad:
            raise ValueError(f"hybrid_pattern {self.hybrid_pattern!r} must be made of M (Mamba), E (MoE) and "
                             f"* (attention), plus - (dense MLP)" + (f"; it has {bad}" if bad else ""))
        if self.moe_router_topk > self.num_experts:
            raise ValueError(f"moe_router_topk {self.moe_router_topk} must be at most num_experts {self.num_experts}")
        for name in ("image_size", "max_image_size"):
            if getattr(self, name) % (self.patch_size * self.shuffle_side):
                raise ValueError(f"{name} {getattr(self, name)} is not a multiple of "
                                 f"{self.patch_size * self.shuffle_side} (patch_size x the pixel-shuffle side)")
        self.image_mean, self.image_std = tuple(self.image_mean), tuple(self.image_std)  # YAML gives lists
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError(f"image_mean and image_std need 3 values (RGB), the std's positive; got "
                             f"{self.image_mean}, {self.image_std}")
        if self.video_temporal_patch_size > 1 and not self.dynamic_resolution:
            raise ValueError(f"video_temporal_patch_size {self.video_temporal_patch_size} must be 1, or more with "
                             f"dynamic_resolution (megatron-core's RADIO groups frames only there)")
        if self.dynamic_resolution and not 1 <= self.min_patches <= self.max_patches <= self.max_grid ** 2:
            raise ValueError(f"need 1 <= min_patches <= max_patches <= {self.max_grid ** 2} (the position grid of "
                             f"max_image_size), got {self.min_patches}, {self.max_patches}")
        self._check_media()
        if self.image_token_id is not None and self.image_token_id >= self.vocab_size:
            raise ValueError(f"image_token_id {self.image_token_id} is outside the vocabulary of {self.vocab_size}")

    def _check_media(self):
        """What a synthetic sample carries: some media, a video of frames, exact patch grids, room for text."""
        if self.images_per_sample == 0 and self.video_frames == 0:
            raise ValueError("images_per_sample 0 and video_frames 0 leave a sample no media: for text-only samples "
                             "set image_probability=0")
        if self.video_frames == 1:
            raise ValueError("video_frames 1 is an image, not a clip: a clip has 2 frames or more (or use "
                             "images_per_sample)")
        if self.patches_per_image:
            if not self.dynamic_resolution:
                raise ValueError(f"patches_per_image {self.patches_per_image} needs dynamic_resolution (fixed tiles "
                                 f"have (image_size / patch_size)^2 patches each)")
            if not self.min_patches <= self.patches_per_image <= self.max_patches:
                raise ValueError(f"patches_per_image {self.patches_per_image} is outside [min_patches, max_patches] "
                                 f"= [{self.min_patches}, {self.max_patches}]")
            if self.fixed_grid is None:
                raise ValueError(f"patches_per_image {self.patches_per_image} has no grid with sides that are "
                                 f"multiples of {self.shuffle_side} and at most {self.max_grid} patches (e.g. "
                                 f"{(self.max_grid // 2) ** 2} does)")
        if self.max_media_tokens >= self.seq_length:
            if self.images_per_sample == 1 and not self.video_frames:
                media = "an image"
            else:
                parts = [f"{self.images_per_sample} images"] if self.images_per_sample else []
                if self.video_frames:
                    parts.append(f"a video of {self.video_frames} frames ({self.video_sequences} sequences of "
                                 f"video_temporal_patch_size {self.video_temporal_patch_size})")
                media = " and ".join(parts) + f", up to {self.max_image_tokens} tokens a sequence,"
            raise ValueError(f"{media} can take {self.max_media_tokens} tokens, which leaves no text in "
                             f"seq_length {self.seq_length}")

    # -- derived quantities

    @property
    def num_layers(self) -> int:
        return len(self.hybrid_pattern)

    @property
    def shuffle_factor(self) -> int:
        """Patches merged into one token (1 or 4)."""
        return 4 if self.pixel_shuffle else 1

    @property
    def shuffle_side(self) -> int:
        return math.isqrt(self.shuffle_factor)

    @property
    def max_grid(self) -> int:
        return self.max_image_size // self.patch_size

    @property
    def max_image_tokens(self) -> int:
        """Tokens of the largest image (or video tubelet) the synthetic data makes."""
        patches = self.max_patches if self.dynamic_resolution else (self.image_size // self.patch_size) ** 2
        return (self.patches_per_image or patches) // self.shuffle_factor

    @property
    def fixed_grid(self) -> tuple[int, int] | None:
        """patches_per_image as (rows, cols), rows <= cols, nearest a square with sides that are multiples of the
        pixel-shuffle side and at most max_grid; None when unset or when no such grid exists."""
        n, step = self.patches_per_image, self.shuffle_side
        for rows in range(math.isqrt(n) // step * step, 0, -step) if n else ():
            if n % rows == 0 and (n // rows) % step == 0 and n // rows <= self.max_grid:
                return rows, n // rows
        return None

    @property
    def video_sequences(self) -> int:
        """Sequences RADIO encodes of a sample's video: one per group of video_temporal_patch_size frames (the last
        padded), one per frame without a video embedder (mimo.plugins.data.clip_tubelets)."""
        if not self.video_frames:
            return 0
        return math.ceil(self.video_frames / self.video_temporal_patch_size)

    @property
    def encoder_sequences(self) -> int:
        """Sequences (images and video tubelets) RADIO encodes per sample with media."""
        return self.images_per_sample + self.video_sequences

    @property
    def max_media_tokens(self) -> int:
        """Placeholders a sample's media can take at most."""
        return self.encoder_sequences * self.max_image_tokens

    @property
    def vision_output_size(self) -> int:
        """Width of an encoder token after pixel shuffle: the projection's input size."""
        return self.vision_hidden_size * self.shuffle_factor

    @property
    def has_projection_norm(self) -> bool:
        """Whether the projection has its input RMSNorm: projection_norm applies to the mlp projection only."""
        return self.projection_norm and self.projection == "mlp"

    @property
    def trains_vision(self) -> bool:
        return self.stage == "stage3"
