"""The settings of the Qwen3.5 family: one dataclass; the variants differ only in defaults (see `VARIANTS` in
`__init__.py`). The defaults are the released 9B-style dense model's language model (transformers'
`Qwen3_5TextConfig` defaults) and transformers' vision tower (`Qwen35VisionSettings`, whose fields these inherit:
the vision tower's first, then the language model's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mimo import setting

from .vision import Qwen35VisionSettings

IMAGES = "images"  # the modality slot the vision tower fills (providers/qwen35/vision.py)
ENCODER = "visual"  # the tower's name in it (transformers': model.visual): modality_submodules.images.encoders.visual
LAYER_SYMBOLS = {"G": "gated delta net (linear attention)", "*": "full attention"}
# layer_types entries of transformers' config <-> the pattern's symbols
HF_LAYER_TYPES = {"linear_attention": "G", "full_attention": "*"}
SIZE = {"minimum": 1}


def interleaved_pattern(num_layers: int, full_attention_interval: int = 4) -> str:
    """transformers' default layer_types: every `full_attention_interval`-th layer is full attention."""
    return "".join("*" if (i + 1) % full_attention_interval == 0 else "G" for i in range(num_layers))


@dataclass
class Qwen35Settings(Qwen35VisionSettings):
    # -- kernels
    backend: Literal["auto", "te", "local"] = setting(
        "auto", "te: transformer-engine layers and flash-linear-attention's gated delta rule; local: plain "
                "megatron-core/PyTorch modules (any device); auto: te when both are installed and a GPU is visible")
    expert_gemm: Literal["auto", "grouped_mm", "megatron"] = setting(
        "auto", "routed experts: grouped_mm runs them as two torch grouped GEMMs with the token counts on the GPU "
                "(no host sync; SwiGLU times the routing probabilities between them; expert TP 1, bf16/fp32, no "
                "FP8); megatron: megatron-core's experts (backend te: transformer-engine's grouped GEMM; local: one "
                "MLP per expert); auto: grouped_mm with backend te where it applies")

    # -- language model: a hybrid of gated delta net (linear attention) and gated full attention layers
    layer_pattern: str = setting(interleaved_pattern(32), "one symbol per layer: G gated delta net (linear "
                                                          "attention), * full attention")
    hidden_size: int = setting(4096, "hidden size of the language model", **SIZE)
    num_attention_heads: int = setting(16, "query heads of the full attention layers", **SIZE)
    num_query_groups: int = setting(4, "key/value heads of the full attention layers", **SIZE,
                                    divides="num_attention_heads")
    kv_channels: int = setting(256, "head dimension of the full attention layers", **SIZE)
    rotary_percent: float = setting(0.25, "share of each attention head's dimensions rotated (partial RoPE)",
                                    minimum=0.0, maximum=1.0)
    rotary_base: float = setting(10_000_000.0, "RoPE base (rope_theta)", minimum=1.0)
    mrope_section: tuple[int, ...] = setting(
        (11, 11, 10), "rotary frequencies given to the temporal, height and width position, interleaved "
                      "(T H W T H W ...); they sum to the rotated dimensions / 2")
    linear_num_key_heads: int = setting(16, "query/key heads of the gated delta net layers", **SIZE,
                                        divides="linear_num_value_heads")
    linear_num_value_heads: int = setting(32, "value heads of the gated delta net layers", **SIZE)
    linear_key_head_dim: int = setting(128, "query/key head dimension of the gated delta net layers", **SIZE)
    linear_value_head_dim: int = setting(128, "value head dimension of the gated delta net layers", **SIZE)
    linear_conv_kernel: int = setting(4, "causal convolution width of the gated delta net layers", **SIZE)
    ffn_hidden_size: int = setting(12288, "hidden size of the dense SwiGLU MLP (num_experts 0)", **SIZE)
    num_experts: int = setting(0, "routed experts of every layer's MoE MLP; 0: a dense MLP", minimum=0)
    moe_router_topk: int = setting(8, "experts each token is routed to (softmax over the top k)", **SIZE)
    moe_ffn_hidden_size: int = setting(512, "hidden size of each routed expert (SwiGLU)", **SIZE)
    moe_shared_expert_intermediate_size: int = setting(
        512, "hidden size of the shared expert (SwiGLU, scaled by a sigmoid gate per token)", **SIZE)
    moe_aux_loss_coeff: float = setting(0.001, "coefficient of the load-balancing loss", minimum=0.0)
    norm_epsilon: float = setting(1e-6, "epsilon of every RMSNorm", minimum=0.0)
    tie_word_embeddings: bool = setting(False, "the output layer shares the embedding's weight")
    vocab_size: int = setting(248320, "vocabulary size", **SIZE)
    seq_length: int = setting(4096, "tokens per sample", **SIZE)
    init_method_std: float = setting(0.02, "standard deviation of the initial weights", minimum=0.0)
    dropout: float = setting(0.0, "hidden and attention dropout", minimum=0.0, maximum=1.0)

    tokenizer_path: str | None = setting(
        None, "local Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json; vocab_size must hold its "
              "ids) for generation; default: UTF-8 bytes, which needs vocab_size >= 260")
    chat_template: Literal["auto", "tokenizer", "plain"] = setting(
        "auto", "prompt format: tokenizer, the tokenizer folder's own Jinja template (Qwen's ChatML, images as "
                "<|vision_start|><|image_pad|><|vision_end|>); plain: no turn markers; auto: the folder's own where "
                "it has one, else plain")
    image_token_id: int | None = setting(
        None, "image placeholder token (Qwen3.5's <|image_pad|> is 248056; default: vocab_size - 1)", minimum=0)
    shuffle_buffer: int = setting(100, "--data: energon's sample shuffle buffer (0: none; shards still shuffle)",
                                  minimum=0)

    # -- synthetic data
    num_classes: int = setting(16, "synthetic data: caption classes; a sample is an image of its class's pattern "
                                   "(or, without images, a token naming the class), then the class's caption",
                               **SIZE)
    images_per_sample: int = setting(1, "synthetic data: images of the class's pattern before each caption; 0: "
                                        "text only (the language model alone learns)", minimum=0)

    def __post_init__(self):
        super().__post_init__()  # the vision tower's and the images' checks
        bad = sorted(set(self.layer_pattern) - set(LAYER_SYMBOLS))
        if not self.layer_pattern or bad:
            raise ValueError(f"layer_pattern {self.layer_pattern!r} must be made of G (gated delta net) and "
                             f"* (full attention)" + (f"; it has {bad}" if bad else ""))
        self.mrope_section = tuple(self.mrope_section)  # YAML gives a list
        rotary_pairs = int(self.kv_channels * self.rotary_percent) // 2
        if len(self.mrope_section) != 3 or min(self.mrope_section) < 0 or sum(self.mrope_section) != rotary_pairs:
            raise ValueError(f"mrope_section {list(self.mrope_section)} must be 3 sizes (temporal, height, width) "
                             f"summing to kv_channels x rotary_percent / 2 = {rotary_pairs}")
        if self.num_experts and self.moe_router_topk > self.num_experts:
            raise ValueError(f"moe_router_topk {self.moe_router_topk} must be at most num_experts "
                             f"{self.num_experts}")
        if self.image_token_id is not None and self.image_token_id >= self.vocab_size:
            raise ValueError(f"image_token_id {self.image_token_id} is outside the vocabulary of {self.vocab_size}")
        if self.seq_length < 2:
            raise ValueError(f"seq_length {self.seq_length} leaves no token to predict: 2 or more")

    # -- derived quantities

    @property
    def num_layers(self) -> int:
        return len(self.layer_pattern)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def image_token(self) -> int:
        """The image placeholder's id: image_token_id, else the vocabulary's last id."""
        return self.vocab_size - 1 if self.image_token_id is None else self.image_token_id
