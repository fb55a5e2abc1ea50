"""Provider settings: typed, strict, with the closest valid name in every error."""

from dataclasses import dataclass, field
from typing import Literal

import pytest

from mimo import Provider, setting
from mimo.errors import UsageError
from mimo.plugins.constraints import describe
from mimo.plugins.settings import build_settings, describe_fields


@dataclass
class Shape:
    layers: int = field(default=2, metadata={"help": "layers"})
    width: float = 1.0
    name: str = "tiny"
    mode: Literal["a", "b"] = "a"
    heads: int | None = None
    flag: bool = False
    mean: tuple[float, ...] = (0.5, 0.5)

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


def test_set_a_list():
    assert build_settings(PROVIDER, ["mean=[1, 0.25]"]).mean == [1, 0.25]


@pytest.mark.parametrize("assignment, message", [
    ("layer=3", "unknown setting 'layer' for provider 'shape' (--set); did you mean 'layers'?"),
    ("layers=abc", "setting 'layers' of provider 'shape' must be an integer, got 'abc'"),
    ("layers=1.5", "must be an integer, got 1.5"),
    ("mode=c", "must be one of 'a', 'b', got 'c'"),
    ("flag=maybe", "must be true or false"),
    ("layers", "--set expects key=value, got 'layers'"),
    ("layers=0", "invalid settings for provider 'shape': layers must be at least 1"),
    ("mean=1,2", "setting 'mean' of provider 'shape' must be a list of numbers, written [a, b, ...], got '1,2'"),
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
    with pytest.raises(UsageError, match="--provider-config .*missing.yaml: no such file"):
        build_settings(PROVIDER, [], tmp_path / "missing.yaml")
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(UsageError, match="must hold a mapping"):
        build_settings(PROVIDER, [], listing)


def test_describe_fields_shows_variant_defaults():
    rows = {r["name"]: r for r in describe_fields(Shape, {"width": 2.0})}
    assert rows["width"]["default"] == 2.0 and rows["layers"]["help"] == "layers"
    assert rows["mode"]["type"] == "one of 'a', 'b'"


# ---- declared constraints (field metadata), as a third-party provider writes them

@dataclass
class Declared:
    hidden: int = field(default=32, metadata={"help": "width", "minimum": 1})
    heads: int = field(default=4, metadata={"minimum": 1, "divides": "hidden"})
    image: int = field(default=16, metadata={"minimum": 1, "multiple_of": ["patch", 8]})
    patch: int = setting(4, "patch side", minimum=1)
    kernel: int = setting(4, "conv width", choices=(2, 3, 4))
    ratio: float = setting(0.5, "a share", minimum=0.0, maximum=1.0)
    ffn: int | None = setting(None, "MLP width (default 4 x hidden)", minimum=1, multiple_of="heads")

    def __post_init__(self):
        assert self.image % self.patch == 0  # declared rules ran first: never reached with a bad value


DECLARED = Provider("declared", "test", Declared)


@pytest.mark.parametrize("assignments, message", [
    (["hidden=-4"], "setting 'hidden' of provider 'declared' is -4: it must be at least 1"),
    (["hidden=0"], "setting 'hidden' of provider 'declared' is 0: it must be at least 1"),
    (["hidden=30", "heads=7"], "setting 'heads' of provider 'declared' is 7: it must divide hidden (30)"),
    (["image=18"], "setting 'image' of provider 'declared' is 18: it must be a multiple of patch (4)"),
    (["image=12", "patch=3"], "setting 'image' of provider 'declared' is 12: it must be a multiple of 8"),
    (["patch=0"], "setting 'patch' of provider 'declared' is 0: it must be at least 1"),  # not a division by 0
    (["kernel=5"], "setting 'kernel' of provider 'declared' is 5: it must be one of 2, 3, 4"),
    (["ratio=1.5"], "setting 'ratio' of provider 'declared' is 1.5: it must be at most 1.0"),
    (["ffn=6"], "setting 'ffn' of provider 'declared' is 6: it must be a multiple of heads (4)"),
])
def test_declared_rules_refuse_with_one_line(assignments, message):
    with pytest.raises(UsageError) as err:
        build_settings(DECLARED, assignments)
    assert str(err.value) == message


def test_declared_rules_accept_valid_values_and_skip_none(tmp_path):
    s = build_settings(DECLARED, ["hidden=48", "heads=6", "image=24", "patch=8", "kernel=2", "ffn=12"])
    assert (s.hidden, s.heads, s.image, s.ffn) == (48, 6, 24, 12)
    assert build_settings(DECLARED).ffn is None  # an unset optional size is not checked
    config = tmp_path / "s.yaml"
    config.write_text("heads: 5\n")  # a config file goes through the same checker
    with pytest.raises(UsageError, match="'heads' of provider 'declared' is 5: it must divide hidden"):
        build_settings(DECLARED, [], config)


def test_wrong_declarations_are_named():
    @dataclass
    class Misspelt:
        layers: int = field(default=2, metadata={"minimun": 1})

    @dataclass
    class Dangling:
        heads: int = field(default=2, metadata={"divides": "hiden"})
        hidden: int = 4

    with pytest.raises(UsageError, match=r"Misspelt.layers declares metadata 'minimun'; did you mean 'minimum'"):
        build_settings(Provider("m", "test", Misspelt))
    with pytest.raises(UsageError, match=r"Dangling.heads declares divides 'hiden', which is not a setting; did "
                                         r"you mean 'hidden'"):
        build_settings(Provider("d", "test", Dangling))


def test_describe_fields_lists_the_rules():
    rows = {r["name"]: r for r in describe_fields(Declared)}
    assert rows["heads"]["rules"] == {"minimum": 1, "divides": "hidden"}
    assert rows["hidden"]["help"] == "width"
    assert describe(rows["image"]["rules"]) == ">= 1, multiple of patch, multiple of 8"
    assert describe(rows["ratio"]["rules"]) == ">= 0.0, <= 1.0"
    assert describe(rows["kernel"]["rules"]) == "one of 2, 3, 4"
    assert rows["patch"]["help"] == "patch side" and rows["ffn"]["default"] is None


@pytest.mark.parametrize("assignments, message", [
    (["hidden_size=-4"], "setting 'hidden_size' of provider 'mock-vlm' is -4: it must be at least 1"),
    (["hidden_size=60", "num_attention_heads=7"],
     "setting 'num_attention_heads' of provider 'mock-vlm' is 7: it must divide hidden_size (60)"),
    (["patch_size=0"], "setting 'patch_size' of provider 'mock-vlm' is 0: it must be at least 1"),
    (["image_size=30"], "setting 'image_size' of provider 'mock-vlm' is 30: it must be a multiple of patch_size (8)"),
])
def test_mock_vlm_declares_its_rules(assignments, message):
    from mimo.providers.mock_vlm import MockVLMSettings

    with pytest.raises(UsageError) as err:
        build_settings(Provider("mock-vlm", "test", MockVLMSettings), assignments)
    assert str(err.value) == message



def test_a_provider_config_that_names_its_provider_stands_in_for_provider(tmp_path):
    """`mimo ckpt import-hf` writes `provider: NAME` into provider.yaml: `--provider-config` of it is enough."""
    from typer.testing import CliRunner

    from mimo.cli.main import app

    named, unnamed = tmp_path / "named.yaml", tmp_path / "unnamed.yaml"
    named.write_text("provider: mock-vlm\nimage_probability: 0.5\n")
    unnamed.write_text("image_probability: 0.5\n")
    result = CliRunner().invoke(app, ["plan", "--provider-config", str(named), "--device", "cpu"])
    assert result.exit_code == 0 and "Layout valid" in result.output, result.output
    result = CliRunner().invoke(app, ["plan", "--provider-config", str(unnamed), "--device", "cpu"])
    assert result.exit_code == 2 and "--provider NAME is needed" in result.output


@pytest.mark.parametrize("assignment, message", [
    ("lora_rank=4", "--set lora_rank=4: 'lora_rank' is a loop option, not a provider setting: pass --lora-rank 4"),
    ("lr=0.1", "--set lr=0.1: 'lr' is a loop option, not a provider setting: pass --lr 0.1"),
    ("overlap_grad_reduce=false", "pass --no-overlap-grad-reduce"),
    ("overlap_grad_reduce=true", "pass --overlap-grad-reduce"),
])
def test_a_loop_option_given_as_a_setting_names_its_option(assignment, message):
    from mimo.core.config import RunConfig
    from mimo.core.run.plan import prepare

    with pytest.raises(UsageError) as err:
        prepare(RunConfig(provider="mock-vlm", provider_settings=[assignment]), world_size=1)
    assert message in str(err.value) and "unknown setting" not in str(err.value)


def test_a_loop_option_in_a_run_files_settings_names_its_section(tmp_path):
    from mimo.core import run_file
    from mimo.core.config import RunConfig
    from mimo.core.run.plan import prepare

    path = tmp_path / "run.yaml"
    path.write_text("provider: mock-vlm\nsettings:\n  lora_rank: 4\n")
    config = RunConfig(provider="mock-vlm", provider_values=run_file.read(path)["settings"], config_file=path)
    with pytest.raises(UsageError, match="'lora_rank' is a loop option, not a provider setting: move it from "
                                         "section 'settings' to section 'adapters'"):
        prepare(config, world_size=1)
