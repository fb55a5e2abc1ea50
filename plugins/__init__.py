"""mimo's public plugin API: everything a provider package imports from mimo.

The contract (hookspecs, the registry, the records passed to hooks, the `DataSource` that `data_provider`
returns, typed settings, module names) lives here; `mimo.plugins.kit` holds what providers may reuse (SDPA
attention, per-layer memory formulas, dist-checkpoint loading, safetensors folders) and `mimo.plugins.data` the
pieces for reading `--data`.
"""

from .constraints import setting
from .context import BuildContext, DataContext, ModuleParallelism
from .data_source import DataSource
from .hookspecs import hookimpl
from .manager import ENTRY_POINT_GROUP, Registry
from .kit import memory_layers  # per-layer formulas for module_memory hooks
from .memory import LayerMemory, ModuleMemory, TokenBytes, Weights
from .modules import LANGUAGE, module_prefix
from .types import Encoder, KernelConfigs, ModuleShape, PromptFormat, Provider

__all__ = [
    "BuildContext", "DataContext", "DataSource", "ENTRY_POINT_GROUP", "Encoder", "KernelConfigs", "LANGUAGE",
    "LayerMemory", "ModuleMemory", "ModuleParallelism", "ModuleShape", "PromptFormat", "Provider", "Registry",
    "SDPAttention", "TokenBytes", "Weights", "hookimpl", "memory_layers", "module_prefix", "setting",
]


def __getattr__(name: str):
    # Layers import megatron-core (seconds): loaded when a provider asks for one, not with the hooks.
    if name == "SDPAttention":
        from .kit.attention import SDPAttention

        return SDPAttention
    raise AttributeError(f"module 'mimo.plugins' has no attribute '{name}'")
