"""Plugin discovery and validation, with plugins registered and unregistered per test."""

import types
from dataclasses import dataclass

import pytest

import mimo
from mimo.errors import UsageError
from mimo.plugins import Registry


@dataclass
class Settings:
    size: int = 1


def make_plugin(name: str, providers=("p",), skip=(), **extra):
    """A provider plugin module implementing every required hook (except `skip`)."""
    module = types.ModuleType(name)

    @mimo.hookimpl
    def register_providers():
        return [mimo.Provider(p, f"{p} from {name}", Settings) for p in providers]

    @mimo.hookimpl
    def model_shape(settings):
        return {"language": mimo.ModuleShape(1, 8, 1)}

    @mimo.hookimpl
    def build_encoders(settings, ctx):
        return f"encoders of {name}"

    @mimo.hookimpl
    def build_language_model(settings, ctx):
        return f"lm of {name}"

    @mimo.hookimpl
    def data_provider(settings, ctx):
        return iter(())

    hooks = dict(register_providers=register_providers, model_shape=model_shape, build_encoders=build_encoders,
                 build_language_model=build_language_model, data_provider=data_provider)
    hooks.update(extra)
    for hook, fn in hooks.items():
        if hook not in skip:
            setattr(module, hook, fn)
    return module


@pytest.fixture
def registry_of():
    """Build a Registry from in-memory plugins; unregister them all afterwards."""
    made = []

    def build(*plugins):
        registry = Registry([(name, dist, lambda m=module: m) for name, dist, module in plugins])
        made.append(registry)
        return registry

    yield build
    for registry in made:
        for plugin in list(registry.manager.get_plugins()):
            registry.manager.unregister(plugin)


def test_providers_are_found_with_their_distribution(registry_of):
    registry = registry_of(("a", "dist-a 1.0", make_plugin("a", ["alpha", "beta"])))
    assert sorted(registry.providers) == ["alpha", "beta"]
    provider, plugin = registry.get("alpha")
    assert provider.settings is Settings and plugin.distribution == "dist-a 1.0"


def test_hooks_call_only_the_chosen_providers_plugin(registry_of):
    registry = registry_of(("a", "dist-a", make_plugin("a", ["alpha"])), ("b", "dist-b", make_plugin("b", ["beta"])))
    assert registry.hooks("alpha").build_encoders(settings=None, ctx=None) == "encoders of a"
    assert registry.hooks("beta").build_language_model(settings=None, ctx=None) == "lm of b"


def test_extension_plugin_without_providers_applies_to_all(registry_of):
    extension = types.ModuleType("ext")

    @mimo.hookimpl
    def loss(output_tensor, loss_mask):
        return "custom loss"

    extension.loss = loss
    registry = registry_of(("a", "dist-a", make_plugin("a", ["alpha"])), ("ext", "dist-ext", extension))
    assert registry.hooks("alpha").loss(settings=None, output_tensor=None, loss_mask=None) == "custom loss"


def test_default_loss_is_per_token_sum(registry_of):
    import torch

    registry = registry_of(("a", "dist-a", make_plugin("a", ["alpha"])))
    loss_sum, tokens = registry.hooks("alpha").loss(
        settings=None, output_tensor=torch.tensor([[1.0, 2.0, 3.0]]), loss_mask=torch.tensor([[1.0, 0.0, 1.0]]))
    assert loss_sum.item() == 4.0 and tokens.item() == 2


def test_name_conflict_names_both_distributions(registry_of):
    registry = registry_of(("x", "dist-one 1.0", make_plugin("x", ["same"])),
                           ("y", "dist-two 2.0", make_plugin("y", ["same"])))
    with pytest.raises(UsageError) as err:
        registry.get("same")
    assert "dist-one 1.0" in str(err.value) and "dist-two 2.0" in str(err.value)


def test_broken_import_is_reported_and_others_still_load(registry_of):
    def failing_import():
        raise ImportError("No module named 'missing_dependency'")

    registry = Registry([("bad", "dist-bad 0.1", failing_import), ("a", "dist-a", lambda: make_plugin("a"))])
    assert [p.name for p in registry.broken] == ["bad"]
    assert "missing_dependency" in registry.broken[0].error
    assert registry.get("p")[1].distribution == "dist-a"


def test_unknown_hook_name_is_rejected(registry_of):
    @mimo.hookimpl
    def build_encoder(settings, ctx):  # misspelt hook
        return None

    registry = registry_of(("typo", "dist-typo", make_plugin("typo", ["t"], build_encoder=build_encoder)),
                           ("a", "dist-a", make_plugin("a", ["alpha"])))
    assert "build_encoder" in registry.broken[0].error and "t" not in registry.providers
    assert "alpha" in registry.providers


def test_wrong_hook_arguments_are_rejected(registry_of):
    @mimo.hookimpl
    def data_provider(settings, ctx, extra_argument):
        return None

    registry = registry_of(("w", "dist-w", make_plugin("w", ["w"], data_provider=data_provider)))
    assert "extra_argument" in registry.broken[0].error


def test_provider_missing_a_required_hook_is_rejected(registry_of):
    registry = registry_of(("m", "dist-m", make_plugin("m", ["m"], skip=("build_encoders",))))
    assert "build_encoders" in registry.broken[0].error and not registry.providers


def test_unknown_provider_suggests_the_closest(registry_of):
    registry = registry_of(("a", "dist-a", make_plugin("a", ["mock-vlm", "other"])))
    with pytest.raises(UsageError, match=r"unknown provider 'mock-vl'; did you mean 'mock-vlm'\? \(available: mock-vlm, other\)"):
        registry.get("mock-vl")
