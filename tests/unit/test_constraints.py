"""Declared setting constraints from a third-party provider's point of view, and the contract kit's check that
integer size settings refuse 0 and negative values with one line."""

import sys
from dataclasses import dataclass, field

import pytest

import mimo
from helpers import REPO
from mimo.errors import UsageError
from mimo.plugins import Registry
from mimo.plugins.settings import build_settings
from mimo.testing import ContractError, check_size_settings, load_subject


@pytest.fixture(scope="module")
def example_registry():
    """The example third-party provider (tests/example_provider), registered from its module."""
    sys.path.insert(0, str(REPO / "tests" / "example_provider"))
    try:
        import mimo_example_provider
    finally:
        sys.path.pop(0)
    return Registry([("patch-vlm", "mimo-example-provider 0.3.0", lambda: mimo_example_provider)])


def test_third_party_declared_rules_are_enforced(example_registry):
    provider, _ = example_registry.get("patch-vlm")
    assert build_settings(provider, ["heads=4", "image=12", "patch=3"]).heads == 4
    for assignments, message in (
            (["heads=3"], "'heads' of provider 'patch-vlm' is 3: it must divide hidden_size (32)"),
            (["image=10"], "'image' of provider 'patch-vlm' is 10: it must be a multiple of patch (4)"),
            (["dropout=-0.1"], "'dropout' of provider 'patch-vlm' is -0.1: it must be at least 0.0"),
            (["vocab=1"], "'vocab' of provider 'patch-vlm' is 1: it must be at least 2")):
        with pytest.raises(UsageError) as err:
            build_settings(provider, assignments)
        assert message in str(err.value) and "\n" not in str(err.value)


def test_the_contract_kit_passes_declared_sizes(example_registry):
    checked = check_size_settings(load_subject("patch-vlm", registry=example_registry))
    assert checked == ["hidden_size", "layers", "heads", "patch", "image", "vocab", "seq_length"]


def _registry_for(settings_class):
    module = type(sys)("undeclared_vlm")

    @mimo.hookimpl
    def register_providers():
        return [mimo.Provider("undeclared-vlm", "sizes without rules", settings_class)]

    module.register_providers = register_providers
    for hook in ("model_shape", "build_encoders", "build_language_model", "data_provider"):
        setattr(module, hook, lambda settings: None)
    return Registry([("undeclared", "undeclared-vlm 1.0", lambda: module)])


@dataclass
class Undeclared:
    layers: int = 2


@dataclass
class Dividing:
    hidden: int = field(default=8, metadata={"minimum": 1})
    heads: int = 2  # no rule declared: __post_init__ meets the 0

    def __post_init__(self):
        self.head_dim = self.hidden // self.heads


@dataclass
class ZeroMeansNone:
    buffer: int = field(default=4, metadata={"minimum": 0})  # 0: none; only -1 must be refused

    def __post_init__(self):
        if self.buffer < 0:
            raise ValueError(f"buffer must be 0 or more, got {self.buffer}")


@pytest.mark.parametrize("settings_class, message", [
    (Undeclared, "settings: --set layers=0 is accepted: an integer size setting must refuse 0 and negative values "
                 "(declare minimum=1 in the field's metadata; 0 means none? declare minimum=0)"),
    (Dividing, "settings: --set heads=0 raised ZeroDivisionError: integer division or modulo by zero"),
])
def test_the_contract_kit_finds_sizes_that_take_zero(settings_class, message):
    with pytest.raises(ContractError) as err:
        check_size_settings(load_subject("undeclared-vlm", registry=_registry_for(settings_class)))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_declared_zero_is_allowed_and_negatives_still_checked():
    assert check_size_settings(load_subject("undeclared-vlm", registry=_registry_for(ZeroMeansNone))) == ["buffer"]
