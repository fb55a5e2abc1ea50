"""mimo: multimodal training on megatron-core, with model families as plugins."""

__version__ = "0.1.0"
__all__ = [
    "BuildContext", "DataContext", "DataSource", "Encoder", "KernelConfigs", "LANGUAGE", "ModuleParallelism",
    "ModuleShape", "PromptFormat", "Provider", "SDPAttention", "hookimpl", "module_prefix", "setting",
]


def __getattr__(name: str):
    # The public API lives in mimo.plugins, which imports torch (seconds): loaded on first use, so `mimo --help`
    # and the CLI's set-up (which must run before torch and its libraries load) do not wait for it.
    if name in __all__:
        import mimo.plugins

        return getattr(mimo.plugins, name)
    raise AttributeError(f"module 'mimo' has no attribute '{name}'")
