"""The provider under test: found through the same Registry `mimo run` uses, with every hook call recorded."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

from mimo.errors import UsageError
from mimo.plugins import Provider, Registry, hookspecs
from mimo.plugins.manager import Plugin
from mimo.plugins.settings import build_settings

from .report import ContractError

MIMO_DISTRIBUTION = "mimo"  # the distribution whose entry points register the built-in providers


@dataclass
class Subject:
    """One provider, its plugin and registry, and its settings for the checks."""

    name: str
    provider: Provider
    plugin: Plugin
    registry: Registry
    assignments: tuple[str, ...]
    settings: object
    called: set[str] = field(default_factory=set)  # hook names called through the registry so far

    def hook(self, name: str):
        """A hook caller for any hookspec, limited to this provider's plugin (and plugins with no provider)."""
        others = [p.module for p in self.registry.plugins if p.providers and p is not self.plugin]
        return self.registry.manager.subset_hook_caller(name, remove_plugins=others)

    def call(self, name: str, context: str = "", **kwargs):
        """Call hook `name` as the loop does; an exception inside it becomes a ContractError naming the hook."""
        try:
            return self.hook(name)(**kwargs)
        except ContractError:
            raise
        except Exception as err:  # noqa: BLE001 - whatever the provider raised, the hook is what broke
            raise ContractError(name, f"raised {type(err).__name__}: {err}{context}") from err


def load_subject(name: str, assignments=(), registry: Registry | None = None) -> Subject:
    """Find provider `name` (installed entry points unless `registry` is given) and build its settings from its
    defaults and `--set`-style `assignments`. Raises ContractError when it cannot be found or configured."""
    registry = registry or Registry()
    try:
        provider, plugin = registry.get(name)
    except UsageError as err:
        broken = "; ".join(f"{p.name} ({p.distribution}): {p.error}" for p in registry.broken)
        hint = f"; plugins that failed to load: {broken}" if broken else "; is its distribution installed?"
        raise ContractError("register_providers", f"{err}{hint}") from None
    try:
        settings = build_settings(provider, list(assignments))
    except UsageError as err:
        if dataclasses.is_dataclass(provider.settings):
            check_defaults_exist(provider)  # the likelier cause, in words of the contract
        raise ContractError("settings", str(err)) from None
    subject = Subject(name, provider, plugin, registry, tuple(assignments), settings)
    registry.manager.add_hookcall_monitoring(lambda hook, impls, kwargs: subject.called.add(hook),
                                             lambda outcome, hook, impls, kwargs: None)
    return subject


def check_defaults_exist(provider: Provider) -> None:
    """Every field has a default (its own or the variant's): `mimo run --provider NAME` works without --set."""
    required = [f.name for f in dataclasses.fields(provider.settings) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING and f.name not in provider.defaults]
    if required:
        raise ContractError("settings", f"{provider.settings.__name__} fields {required} have no default: "
                                        f"`mimo run --provider {provider.name}` must work without --set")


def hookspec_signatures() -> dict[str, str]:
    """`{hook: "hook(arg, ...)"}` for every hookspec mimo declares now (read at run time, never cached)."""
    specs = {}
    for name, function in vars(hookspecs).items():
        if callable(function) and hasattr(function, f"{hookspecs.hookspec.project_name}_spec"):
            specs[name] = f"{name}({', '.join(inspect.signature(function).parameters)})"
    return specs


def builtin_provider_names(registry: Registry | None = None) -> list[str]:
    """Every provider the `mimo` distribution's own entry points register, in name order."""
    registry = registry or Registry()
    return sorted(name for name, claims in registry.providers.items()
                  if any(plugin.distribution.split(" ")[0] == MIMO_DISTRIBUTION for _, plugin in claims))
