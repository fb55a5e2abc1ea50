"""mimo: multimodal training on megatron-core, with model families as plugins."""

from mimo.plugins import (
    LANGUAGE, BuildContext, DataContext, Encoder, ModuleParallelism, ModuleShape, Provider, hookimpl, module_prefix,
    setting,
)

__version__ = "0.1.0"
__all__ = [
    "BuildContext", "DataContext", "Encoder", "LANGUAGE", "ModuleParallelism", "ModuleShape", "Provider",
    "SDPAttention", "hookimpl", "module_prefix", "setting",
]


def __getattr__(name: str):
    if name == "SDPAttention":  # imports megatron-core: only when a provider's model code asks for it
        import mimo.plugins

        return mimo.plugins.SDPAttention
    raise AttributeError(f"module 'mimo' has no attribute '{name}'")
