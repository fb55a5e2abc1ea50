"""mimo: multimodal training on megatron-core, with model families as plugins."""

from mimo.plugins import (
    BuildContext, DataContext, Encoder, ModuleParallelism, ModuleShape, Provider, hookimpl,
)

__version__ = "0.1.0"
__all__ = [
    "BuildContext", "DataContext", "Encoder", "ModuleParallelism", "ModuleShape", "Provider", "hookimpl",
]
