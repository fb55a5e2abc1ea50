"""The CLI against installed distributions: a third-party provider, a name conflict, a broken plugin."""

import json

import pytest

from helpers import REPO, install_distribution, read_metrics, run_mimo, write_distribution
from mimo.data import write_sample_dataset

CONFLICT = """
    from dataclasses import dataclass
    import mimo

    @dataclass
    class S:
        size: int = 1

    @mimo.hookimpl
    def register_providers():
        return [mimo.Provider("dup-vlm", "claims a taken name", S)]

    @mimo.hookimpl
    def model_shape(settings):
        return {"language": mimo.ModuleShape(1, 8, 1)}

    @mimo.hookimpl
    def build_encoders(settings, ctx):
        return {}

    @mimo.hookimpl
    def build_language_model(settings, ctx):
        return None

    @mimo.hookimpl
    def data_provider(settings, ctx):
        return iter(())
"""


def providers_json(extra_path=()):
    result = run_mimo("providers", "list", "--json", extra_path=list(extra_path))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_builtin_provider_is_listed_with_its_distribution():
    listing = providers_json()
    row = next(r for r in listing["providers"] if r["name"] == "mock-vlm")
    assert row["distribution"].startswith("mimo ") and row["entry_point"] == "mock-vlm"


def test_unknown_provider_exits_2_and_names_the_available():
    result = run_mimo("run", "--provider", "nope")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]  # one line
    assert "unknown provider 'nope'" in result.stderr and "mock-vlm" in result.stderr


def test_unknown_setting_exits_2_with_one_line():
    result = run_mimo("run", "--provider", "mock-vlm", "--set", "no_such_key=1")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "unknown setting 'no_such_key'" in result.stderr and "Traceback" not in result.stderr


def test_providers_show_lists_settings_and_defaults():
    result = run_mimo("providers", "show", "mock-vlm", "--json")
    settings = {s["name"]: s for s in json.loads(result.stdout)["settings"]}
    assert settings["num_layers"]["default"] == 2 and settings["projection"]["type"] == "one of 'mlp', 'affine'"
    assert settings["num_attention_heads"]["rules"] == {"minimum": 1, "divides": "hidden_size"}
    assert settings["projection"]["rules"] == {}


@pytest.mark.smoke
def test_third_party_distribution_is_listed_and_trains(tmp_target, tmp_path):
    install_distribution(REPO / "tests" / "example_provider", tmp_target)
    row = next(r for r in providers_json([tmp_target])["providers"] if r["name"] == "patch-vlm")
    assert row["distribution"] == "mimo-example-provider 0.3.0"
    metrics = tmp_path / "m.jsonl"
    result = run_mimo("run", "--provider", "patch-vlm", "--train-iters", "4", "--log-interval", "1",
                      "--metrics-file", str(metrics), "--device", "cpu", extra_path=[tmp_target])
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["lm_loss"] for r in read_metrics(metrics)]
    assert len(losses) == 4 and losses[-1] < losses[0]
    # its data_provider ignores ctx.data_path: the loop refuses to train on its synthetic data in place of --data
    data = tmp_path / "ds"
    write_sample_dataset(data, num_samples=8, seed=0, shard_size=8)
    refused = run_mimo("run", "--provider", "patch-vlm", "--train-iters", "1", "--device", "cpu", "--data",
                       str(data), extra_path=[tmp_target])
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-3000:]
    assert "provider 'patch-vlm' does not read datasets" in refused.stderr


def test_two_distributions_claiming_one_name(tmp_target, tmp_path):
    for dist in ("dup-one", "dup-two"):
        module = dist.replace("-", "_")
        install_distribution(write_distribution(tmp_path / dist, dist, module, "dup", CONFLICT), tmp_target)
    rows = [r for r in providers_json([tmp_target])["providers"] if r["name"] == "dup-vlm"]
    assert sorted(r["distribution"] for r in rows) == ["dup-one 1.0", "dup-two 1.0"] and all(r["conflict"] for r in rows)
    result = run_mimo("run", "--provider", "dup-vlm", extra_path=[tmp_target])
    assert result.returncode == 2 and "dup-one 1.0" in result.stderr and "dup-two 1.0" in result.stderr


def test_broken_plugin_is_reported_and_others_work(tmp_target, tmp_path):
    code = "import a_module_that_does_not_exist\n"
    install_distribution(write_distribution(tmp_path / "broken", "broken-provider", "broken_provider", "broken",
                                            code), tmp_target)
    listing = providers_json([tmp_target])
    assert listing["broken"] == [{"entry_point": "broken", "distribution": "broken-provider 1.0",
                                  "error": "ModuleNotFoundError: No module named 'a_module_that_does_not_exist'"}]
    assert any(r["name"] == "mock-vlm" for r in listing["providers"])
    result = run_mimo("run", "--provider", "mock-vlm", "--train-iters", "1", "--device", "cpu",
                      extra_path=[tmp_target])
    assert result.returncode == 0, result.stderr[-3000:]
