"""Provider settings: typed, strict, with the closest valid name in every error."""

from dataclasses import dataclass, field
from typing import Literal

import pytest

from mimo import Provider
from mimo.errors import UsageError
from mimo.plugins.settings import build_settings, describe_fields


@dataclass
class Shape:
    layers: int = field(default=2, metadata={"help": "layers"})
    width: float = 1.0
    name: str = "tiny"
    mode: Literal["a", "b"] = "a"
    heads: int | None = None
    flag: bool = False

    def __post_init__(self):
        if self.layers < 1:
            raise ValueError("layers must be at least 1")


PROVIDER = Provider("shape", "test", Shape, defaults={"width": 2.0})


def test_defaults_then_variant_overrides():
    s = build_settings(PROVIDER)
    assert (s.layers, s.width, s.mode) == (2, 2.0, "a")


def test_set_parses_typed_values():
    s = build_settings(PROVIDER, ["layers=5", "width=3", "name=123", "mode=b", "heads=8", "flag=true"])
    assert (s.layers, s.width, s.name, s.mode, s.heads, s.flag) == (5, 3.0, "123", "b", 8, True)
    assert isinstance(s.width, float) and isinstance(s.name, str)


def test_exponent_without_a_dot_is_a_number(tmp_path):
    assert build_settings(PROVIDER, ["width=1e-3"]).width == 0.001
    config = tmp_path / "s.yaml"
    config.write_text("width: 2e-2\n")
    assert build_settings(PROVIDER, [], config).width == 0.02


def test_set_null_for_optional():
    assert build_settings(PROVIDER, ["heads=null"]).heads is None


@pytest.mark.parametrize("assignment, message", [
    ("layer=3", "unknown setting 'layer' for provider 'shape' (--set); did you mean 'layers'?"),
    ("layers=abc", "setting 'layers' of provider 'shape' must be an integer, got 'abc'"),
    ("layers=1.5", "must be an integer, got 1.5"),
    ("mode=c", "must be one of 'a', 'b', got 'c'"),
    ("flag=maybe", "must be true or false"),
    ("layers", "--set expects key=value, got 'layers'"),
    ("layers=0", "invalid settings for provider 'shape': layers must be at least 1"),
])
def test_bad_values_are_one_clear_line(assignment, message):
    with pytest.raises(UsageError) as err:
        build_settings(PROVIDER, [assignment])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_config_files_yaml_and_toml_and_set_wins(tmp_path):
    yaml_file = tmp_path / "s.yaml"
    yaml_file.write_text("layers: 7\nmode: b\n")
    toml_file = tmp_path / "s.toml"
    toml_file.write_text('layers = 9\nname = "x"\n')
    assert build_settings(PROVIDER, [], yaml_file).layers == 7
    s = build_settings(PROVIDER, ["layers=3"], toml_file)
    assert (s.layers, s.name) == (3, "x")


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("widht: 2\n")
    with pytest.raises(UsageError, match=r"unknown setting 'widht'.*did you mean 'width'"):
        build_settings(PROVIDER, [], bad)
    with pytest.raises(UsageError, match="not found"):
        build_settings(PROVIDER, [], tmp_path / "missing.yaml")
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(UsageError, match="must hold a mapping"):
        build_settings(PROVIDER, [], listing)


def test_describe_fields_shows_variant_defaults():
    rows = {r["name"]: r for r in describe_fields(Shape, {"width": 2.0})}
    assert rows["width"]["default"] == 2.0 and rows["layers"]["help"] == "layers"
    assert rows["mode"]["type"] == "one of 'a', 'b'"
