"""Finds provider plugins through the `mimo.providers` entry points and calls one provider's hooks.

A plugin that fails to import, implements an unknown hook or breaks in `register_providers` is recorded with its
error and left out; the others still load. Two plugins that register one provider name make that name unusable
until one is uninstalled, and the error names both distributions.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field

import pluggy

from mimo.errors import UsageError

from . import defaults, hookspecs
from .hints import suggest
from .types import Provider

ENTRY_POINT_GROUP = "mimo.providers"
REQUIRED_HOOKS = ("model_shape", "build_encoders", "build_language_model", "data_provider")
CALLED_HOOKS = REQUIRED_HOOKS + ("loss", "frozen_parameters", "model_flops", "module_memory", "hf_settings",
                                  "hf_tensor_map", "hf_export_check", "hf_export", "load_pretrained")


@dataclass
class Plugin:
    """One loaded (or broken) plugin: an entry point and the distribution that ships it."""

    name: str
    distribution: str
    module: object | None = None
    error: str | None = None
    providers: list[Provider] = field(default_factory=list)


class ProviderHooks:
    """The hooks of one provider, called on its plugin and on plugins that register no provider."""

    def __init__(self, manager: pluggy.PluginManager, other_provider_plugins: list[object]):
        for name in CALLED_HOOKS:
            setattr(self, name, manager.subset_hook_caller(name, remove_plugins=other_provider_plugins))


class Registry:
    """All installed plugins and the providers they register."""

    def __init__(self, plugins: list[tuple[str, str, object]] | None = None):
        """Load the entry points, or (for tests) the given `(name, distribution, load)` triples."""
        self.manager = pluggy.PluginManager("mimo")
        self.manager.add_hookspecs(hookspecs)
        self.manager.register(defaults, name="mimo.defaults")
        self.plugins: list[Plugin] = []
        for name, distribution, load in plugins if plugins is not None else _entry_points():
            self.plugins.append(self._load(name, distribution, load))
        self._by_name: dict[str, list[tuple[Provider, Plugin]]] = {}
        for plugin in self.plugins:
            for provider in plugin.providers:
                self._by_name.setdefault(provider.name, []).append((provider, plugin))

    def _load(self, name: str, distribution: str, load) -> Plugin:
        plugin = Plugin(name=name, distribution=distribution)
        try:
            module = load()
            self.manager.register(module, name=f"{distribution}:{name}")
        except Exception as err:  # noqa: BLE001 - any import failure is the plugin's, reported not raised
            plugin.error = f"{type(err).__name__}: {err}"
            return plugin
        try:
            self.manager.check_pending()  # rejects hook names that are not in hookspecs
            impls = [i for i in self.manager.hook.register_providers.get_hookimpls() if i.plugin is module]
            for impl in impls:
                plugin.providers.extend(_check_providers(impl.function(), name))
            missing = [h for h in REQUIRED_HOOKS if plugin.providers and not hasattr(module, h)]
            if missing:
                raise TypeError(f"provider plugin implements no {', '.join(missing)} hook")
        except Exception as err:  # noqa: BLE001
            self.manager.unregister(module)
            plugin.error, plugin.providers = f"{type(err).__name__}: {err}", []
            return plugin
        plugin.module = module
        return plugin

    @property
    def providers(self) -> dict[str, list[tuple[Provider, Plugin]]]:
        return self._by_name

    @property
    def broken(self) -> list[Plugin]:
        return [p for p in self.plugins if p.error]

    def get(self, name: str) -> tuple[Provider, Plugin]:
        claims = self._by_name.get(name)
        if not claims:
            available = ", ".join(sorted(self._by_name)) or "none installed"
            raise UsageError(f"unknown provider '{name}'{suggest(name, self._by_name)} (available: {available})")
        if len(claims) > 1:
            owners = " and ".join(f"{p.distribution} (entry point '{p.name}')" for _, p in claims)
            raise UsageError(f"provider '{name}' is registered by both {owners}; uninstall one of them")
        return claims[0]

    def hooks(self, name: str) -> ProviderHooks:
        _, chosen = self.get(name)
        others = [p.module for p in self.plugins if p.providers and p is not chosen]
        return ProviderHooks(self.manager, others)


def _entry_points():
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
        yield ep.name, dist, ep.load


def _check_providers(result, plugin_name: str) -> list[Provider]:
    providers = result if isinstance(result, (list, tuple)) else [result]
    for provider in providers:
        if not isinstance(provider, Provider):
            raise TypeError(f"register_providers of '{plugin_name}' must return mimo.Provider objects")
    return list(providers)
