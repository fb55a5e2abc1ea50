"""mimo's public plugin API: everything a provider package imports from mimo."""

from .constraints import setting
from .context import BuildContext, DataContext, ModuleParallelism
from .hookspecs import hookimpl
from .manager import ENTRY_POINT_GROUP, Registry
from .types import Encoder, ModuleShape, Provider

__all__ = [
    "BuildContext", "DataContext", "ENTRY_POINT_GROUP", "Encoder", "ModuleParallelism", "ModuleShape",
    "Provider", "Registry", "SDPAttention", "hookimpl", "setting",
]


def __getattr__(name: str):
    # Layers import megatron-core (seconds): loaded when a provider asks for one, not with the hooks.
    if name == "SDPAttention":
        from .attention import SDPAttention

        return SDPAttention
    raise AttributeError(f"module 'mimo.plugins' has no attribute '{name}'")
