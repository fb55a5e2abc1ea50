"""patch-vlm: a third-party provider. Its encoder is its own megatron module (a linear patch embedding, not a ViT),
so training it through `mimo run` shows the loop works for models mimo has never seen."""

from dataclasses import dataclass, field

import torch

from mimo import Encoder, ModuleShape, Provider, hookimpl


def _size(default, **rules):
    """Declared rules, as plain field metadata: mimo checks them before the settings are built."""
    return field(default=default, metadata={"minimum": 1, **rules})


@dataclass
class PatchVLMSettings:
    hidden_size: int = _size(32)
    layers: int = _size(1)
    heads: int = _size(2, divides="hidden_size")
    patch: int = _size(4)
    image: int = _size(8, multiple_of="patch")
    vocab: int = _size(64, minimum=2)
    seq_length: int = _size(24)
    dropout: float = field(default=0.0, metadata={"help": "hidden and attention dropout", "minimum": 0.0,
                                                  "maximum": 1.0})

    def __post_init__(self):  # what the declared rules cannot say
        if _tokens(self) >= self.seq_length:
            raise ValueError(f"an image's {_tokens(self)} tokens do not fit in seq_length {self.seq_length}")


def _tokens(s):
    return (s.image // s.patch) ** 2


class PatchEncoder(torch.nn.Module):
    def __init__(self, config, patch, hidden_size):
        super().__init__()
        self.config, self.patch = config, patch  # mimo reads the encoder's TransformerConfig
        self.embed = torch.nn.Linear(3 * patch * patch, hidden_size)

    def forward(self, x):
        p = self.patch
        patches = x.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(x.shape[0], -1, 3 * p * p)
        return self.embed(patches)  # [images, patches, hidden]


@hookimpl
def register_providers():
    return [Provider("patch-vlm", "Linear patch encoder + GPT (third-party example)", PatchVLMSettings)]


@hookimpl
def model_shape(settings):
    return {"images": ModuleShape(1, settings.hidden_size, 1), "language": ModuleShape(
        settings.layers, settings.hidden_size, settings.heads)}


@hookimpl
def build_encoders(settings, ctx):
    from megatron.core.models.mimo.submodules.vision import VisionModalitySubmodules
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import ModuleSpec

    class MegatronPatchEncoder(MegatronModule):
        def __init__(self, config):
            super().__init__(config)
            self.inner = PatchEncoder(config, settings.patch, settings.hidden_size)

        def forward(self, x):
            return self.inner(x)

    config = ctx.transformer_config("images", num_layers=1, hidden_size=settings.hidden_size, num_attention_heads=1)
    spec = ModuleSpec(module=VisionModalitySubmodules, params={"pg_collection": ctx.pg_collection("images")},
                      submodules={"encoders": {"patches": ModuleSpec(module=MegatronPatchEncoder,
                                                                     params={"config": config})}})
    return {"images": Encoder(spec, placeholder_token_id=settings.vocab - 1)}


@hookimpl
def build_language_model(settings, ctx):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    config = ctx.transformer_config("language", num_layers=settings.layers, hidden_size=settings.hidden_size,
                                    num_attention_heads=settings.heads, hidden_dropout=settings.dropout,
                                    attention_dropout=settings.dropout)
    return ModuleSpec(module=GPTModel, params=dict(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=settings.vocab,
        max_sequence_length=settings.seq_length, pg_collection=ctx.pg_collection("language")))


@hookimpl
def data_provider(settings, ctx):
    n = _tokens(settings)
    for indices in ctx.sample_indices():
        gen = torch.Generator().manual_seed(ctx.seed + indices[0])
        colour = torch.randint(0, 4, (len(indices),), generator=gen)
        images = colour.float().view(-1, 1, 1, 1).expand(-1, 3, settings.image, settings.image).contiguous()
        text = (colour.view(-1, 1) * 7 + torch.arange(settings.seq_length - n + 1)) % (settings.vocab - 1)
        tokens = torch.cat([torch.full((len(indices), n), settings.vocab - 1), text], dim=1)
        loss_mask = torch.ones(len(indices), settings.seq_length)
        loss_mask[:, : n - 1] = 0
        labels = tokens[:, 1:].masked_fill(loss_mask == 0, 0)
        yield {"input_ids": tokens[:, :-1], "labels": labels, "loss_mask": loss_mask,
               "position_ids": torch.arange(settings.seq_length).expand(len(indices), -1),
               "modality_inputs": {"images": {"patches": {"x": images}}}}
