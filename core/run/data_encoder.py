"""The task encoder a provider reads `--data` with, for `mimo data inspect` and `mimo data preview`: the
provider's settings built as a run builds them (`--set`, `--provider-config`, `--config`, the Hugging Face folders
of `--pretrained`), then its own `data_provider` hook called with a data context whose `energon_loader` hands the
task encoder back instead of opening a loader. Nothing of the encoding is rebuilt here: what the commands show is
what that encoder (its tokenizer, chat template, image mode and packer) makes of the samples."""

from __future__ import annotations

from dataclasses import dataclass

from mimo.errors import UsageError
from mimo.plugins import DataContext, Registry
from mimo.plugins.settings import build_settings

from .. import run_file
from ..config import RunConfig
from ..checkpoint.hf import hf_base_settings

__all__ = ["ProviderEncoder", "provider_encoder"]


@dataclass
class ProviderEncoder:
    provider: str
    settings: object
    encoder: object  # the task encoder (a mimo.plugins.data.ConversationTaskEncoder for the built-in providers)


class _Unopened:
    """What `energon_loader` returns here: no loader is opened, so there is nothing to read."""

    def __iter__(self):
        return self

    def __next__(self):
        raise StopIteration

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class _EncoderCapture(DataContext):
    """A data context of one lane whose `energon_loader` keeps the task encoder it is given."""

    def energon_loader(self, task_encoder, **dataset_kwargs):
        self.opened_loaders.append(task_encoder)
        return _Unopened()


def provider_encoder(config: RunConfig, split: str = "train") -> ProviderEncoder:
    """The task encoder `config.provider` builds for `config.data.data` (packing as the run's options say), with
    one line (UsageError) when the provider is unknown, a setting is wrong, or it reads no datasets."""
    registry = Registry()
    name = config.provider
    provider, _ = registry.get(name)
    hooks = registry.hooks(name)
    if config.provider_config is not None:
        run_file.refuse_loop_options(config.provider_config, provider.settings)
    settings = build_settings(provider, config.provider_settings, config.provider_config, config.provider_values,
                              config.config_file, base=hf_base_settings(config, provider, hooks))
    ctx = _EncoderCapture(micro_batch_size=1, num_microbatches=1, num_lanes=1, seed=0,
                          data_path=str(config.data.data), pack_sequences=config.data.pack_sequences,
                          packing_buffer_size=config.data.packing_buffer_size, split=split)
    hooks.data_provider(settings=settings, ctx=ctx)
    if not ctx.opened_loaders:
        raise UsageError(f"provider '{name}' does not read datasets (its data_provider opened no "
                         f"ctx.energon_loader): leave out --provider to see the dataset without its encoding")
    encoder = ctx.opened_loaders[-1]
    missing = [attr for attr in ("encode_sample", "tokenizer", "seq_length", "image_mode")
               if not hasattr(encoder, attr)]
    if missing:
        raise UsageError(f"provider '{name}' reads datasets with {type(encoder).__name__}, which has no "
                         f"{', '.join(missing)} (mimo.plugins.data.ConversationTaskEncoder has them): leave out "
                         f"--provider to see the dataset without its encoding")
    return ProviderEncoder(name, settings, encoder)
