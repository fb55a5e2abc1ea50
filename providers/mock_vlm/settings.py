"""mock-vlm's settings: one dataclass for the provider, read before anything is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mimo import setting

IMAGES = "images"  # the modality name, also the encoder grid's module name


SIZE = {"minimum": 1}  # a size or count: 0 and negative values are refused


@dataclass
class MockVLMSettings:
    vision_layers: int = setting(2, "transformer layers of the vision encoder", **SIZE)
    vision_hidden_size: int = setting(64, "hidden size of the vision encoder", **SIZE)
    # megatron-core's attention splits the hidden size evenly over the heads (no kv_channels setting here).
    vision_heads: int = setting(4, "attention heads of the vision encoder", **SIZE, divides="vision_hidden_size")
    image_size: int = setting(32, "image height and width in pixels", **SIZE, multiple_of="patch_size")
    patch_size: int = setting(8, "ViT patch size; an image gives (image_size / patch_size)^2 tokens", **SIZE)
    projection: Literal["mlp", "affine"] = setting("mlp", "projection from vision to LLM hidden size")
    num_layers: int = setting(2, "transformer layers of the language model", **SIZE)
    hidden_size: int = setting(64, "hidden size of the language model", **SIZE)
    num_attention_heads: int = setting(4, "attention heads of the language model", **SIZE, divides="hidden_size")
    ffn_hidden_size: int | None = setting(None, "MLP size of both models (default: 4 x hidden size)", **SIZE)
    # 260 = the byte tokenizer's 256 bytes + pad, bos, eos, image: what `--data` captions need.
    vocab_size: int = setting(260, "vocabulary size; the last id is the image placeholder", minimum=3)
    seq_length: int = setting(64, "tokens per sample, image tokens included", minimum=2)
    image_probability: float = setting(
        1.0, "fraction of samples that carry images (others are text only)", minimum=0.0, maximum=1.0)
    # With vision_layers, vision_hidden_size and image_size: an encoder with a real share of the work.
    images_per_sample: int = setting(1, "synthetic data: images a sample with images carries, their placeholders "
                                        "first", **SIZE)
    num_classes: int = setting(8, "synthetic data: image classes, each with its own caption", **SIZE)
    shuffle_buffer: int = setting(100, "--data: energon's sample shuffle buffer (0: none; shards still shuffle)",
                                   minimum=0)
    chat_template: Literal["plain", "nemotron"] = setting(
        "plain", "--data: prompt format (plain: no turn markers; nemotron: ChatML turns, needs vocab_size >= 264)")
    backend: Literal["auto", "te", "local"] = setting(
        "auto", "te: megatron-core's transformer-engine layer specs (fused norm+linear, flash attention, fused "
                "RoPE; FP8-capable); local: megatron-core's local modules (any device); auto: te when "
                "transformer-engine is installed and a GPU is visible")
    fused_cross_entropy: bool = setting(
        True, "backend te: transformer-engine's fused cross-entropy (no fp32 copy of the logits)")
    attention: Literal["sdpa", "local"] = setting(
        "sdpa", "backend local: core attention by torch's fused SDPA (flash on GPUs) or megatron-core's unfused "
                "DotProductAttention")
    dropout: float = setting(0.0, "hidden and attention dropout of both models", minimum=0.0, maximum=1.0)
    freeze_vision: bool = setting(False, "do not train the ViT (the projection still trains)")
    freeze_language: bool = setting(False, "do not train the language model")

    def __post_init__(self):
        if self.image_tokens >= self.seq_length:
            raise ValueError(f"an image's {self.image_tokens} tokens do not fit in seq_length {self.seq_length}")
        if self.images_per_sample * self.image_tokens >= self.seq_length:
            raise ValueError(f"{self.images_per_sample} images of {self.image_tokens} tokens take "
                             f"{self.images_per_sample * self.image_tokens}, which leaves no text in seq_length "
                             f"{self.seq_length}")

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def image_token_id(self) -> int:
        return self.vocab_size - 1
