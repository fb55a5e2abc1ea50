"""The provider API's contract: every hookspec documented with its exact signature and called by the contract
checks; every built-in provider passes the checks third-party ones run; each check fails with one line naming
the hook and the rule."""

import re
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import mimo
from helpers import REPO, install_distribution, write_distribution
from mimo.plugins import Registry, hookspecs
from mimo.providers import mock_vlm
from mimo.testing import (
    ContractError, builtin_provider_names, check_build_and_train, check_provider, hookspec_signatures,
)
from mimo.testing.model_check import check_model_shape
from mimo.testing.subject import load_subject
from mimo.testing.train_check import too_large

GUIDE = REPO / "docs" / "provider-guide.md"
BUILTINS = builtin_provider_names()  # read at collection: a provider mimo's entry points add is picked up


def test_the_guide_gives_every_hookspec_with_its_exact_signature():
    documented = dict(re.findall(r"^### `((\w+)\([^)]*\))`$", GUIDE.read_text(), flags=re.M))
    documented = {name: signature for signature, name in documented.items()}
    expected = hookspec_signatures()
    missing = {n: s for n, s in expected.items() if documented.get(n) != s}
    stale = sorted(set(documented) - set(expected))
    assert not missing and not stale, (f"docs/provider-guide.md: add or correct the headings ### `{missing}`; "
                                       f"remove the headings of hooks that no longer exist: {stale}")


# -- built-in providers, through the same checks a third-party provider's tests run

@pytest.fixture(scope="module")
def full_check():
    """full_check(name): the complete check of a built-in provider (static and built), run once per module: the
    tests of each provider and the hookspec test read the same outcome (module scope keeps them on one xdist
    worker, tests/conftest.py, so no check is built and trained twice)."""
    outcomes: dict[str, object] = {}  # provider -> ContractReport or the ContractError its full check raised

    def check(name: str):
        if name not in outcomes:
            try:
                outcomes[name] = check_provider(name)
            except ContractError as err:
                outcomes[name] = err
        return outcomes[name]

    return check


def test_mimo_registers_built_in_providers():
    assert "mock-vlm" in BUILTINS, BUILTINS


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_provider_meets_the_static_contract(name):
    print(check_provider(name, build=False).summary())


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_provider_builds_trains_and_checkpoints(full_check, name):
    reason = too_large(check_model_shape(load_subject(name)))
    if reason:
        print(f"{name}: {reason}")
        pytest.skip(f"{name}: {reason}")
    outcome = full_check(name)
    if isinstance(outcome, ContractError):
        raise outcome
    print(outcome.summary())


def test_every_hookspec_is_called_by_the_contract_checks(full_check):
    """A hook nobody calls is a hook nobody tests: the checks of the built-in providers that build on CPU
    must call every hook mimo declares (recorded through the plugin manager, not by name)."""
    called = set()
    for name in BUILTINS:
        if too_large(check_model_shape(load_subject(name))):
            continue
        outcome = full_check(name)
        if not isinstance(outcome, ContractError):
            called |= outcome.hooks_called
    assert called, "no built-in provider passed its full check"
    assert set(hookspec_signatures()) <= called, (
        f"hookspecs {sorted(set(hookspec_signatures()) - called)} are called by no contract check: add a check "
        f"for them to mimo.testing")


# -- each rule fails with one line naming the hook: mock-vlm's hooks with one of them broken, in memory

HOOKS = ("register_providers", "model_shape", "build_encoders", "build_language_model", "data_provider",
         "frozen_parameters")


def plugin(**replaced):
    """A plugin module with mock-vlm's hooks, some replaced."""
    module = types.ModuleType("broken_vlm")
    for hook in HOOKS:
        setattr(module, hook, replaced.get(hook, getattr(mock_vlm, hook)))
    return module


def static_check(module, settings=()):
    return check_provider("mock-vlm", settings, registry=Registry([("broken", "broken-vlm 1.0", lambda: module)]),
                          build=False)


def failure(module, settings=()) -> str:
    with pytest.raises(ContractError) as err:
        static_check(module, settings)
    assert len(str(err.value).splitlines()) == 1
    return str(err.value)


def test_the_unbroken_copy_passes():
    report = static_check(plugin())
    assert report.hooks_called >= {"register_providers", "model_shape", "build_encoders", "build_language_model",
                                   "data_provider"}


def test_encoder_names_must_match_model_shape():
    @mimo.hookimpl
    def build_encoders(settings, ctx):
        return {"img": mock_vlm.build_encoders(settings, ctx)["images"]}

    assert failure(plugin(build_encoders=build_encoders)) == (
        "build_encoders: returned modules ['img'] but model_shape declared ['images']")


def test_build_hooks_must_work_where_no_module_is_held():
    @mimo.hookimpl
    def build_encoders(settings, ctx):
        ctx.pg_collection("images").tp  # a heterogeneous layout's LLM ranks get None here
        return mock_vlm.build_encoders(settings, ctx)

    assert failure(plugin(build_encoders=build_encoders)) == (
        "build_encoders: raised AttributeError: 'NoneType' object has no attribute 'tp' (called as on a rank that "
        "holds no module: every ctx.pg_collection(...) is None)")


def test_model_shape_needs_the_language_model():
    @mimo.hookimpl
    def model_shape(settings):
        return {"images": mock_vlm.model_shape(settings)["images"]}

    assert failure(plugin(model_shape=model_shape)).startswith(
        "model_shape: declared modules ['images'] lack the language model")


def test_language_model_must_be_a_module_spec():
    @mimo.hookimpl
    def build_language_model(settings, ctx):
        return mock_vlm.build_language_model(settings, ctx).module  # the class, not its spec

    assert failure(plugin(build_language_model=build_language_model)) == (
        "build_language_model: must return a megatron-core ModuleSpec (e.g. of GPTModel), got type")


def data_with(change):
    @mimo.hookimpl
    def data_provider(settings, ctx):
        for batch in mock_vlm.data_provider(settings, ctx):
            yield change(batch)

    return plugin(data_provider=data_provider)


def test_micro_batch_needs_every_key():
    message = failure(data_with(lambda b: {k: v for k, v in b.items() if k != "loss_mask"}))
    assert message.startswith("data_provider: micro-batch 0 lacks ['loss_mask']")


def test_images_need_placeholders_and_placeholders_need_images():
    message = failure(data_with(lambda b: {**b, "modality_inputs": {}}))
    assert message == ("data_provider: micro-batch 0 has 32 'images' placeholder tokens (id 259) but no "
                       "modality_inputs['images']")


def test_encoder_inputs_use_the_specs_encoder_and_argument_names():
    renamed = failure(data_with(lambda b: {**b, "modality_inputs": {"images": {
        "vitt": b["modality_inputs"]["images"]["vit"]}}}))
    assert "has inputs for encoders ['vitt'] but the 'images' spec of build_encoders has encoders ['vit']" in renamed
    wrong_argument = failure(data_with(lambda b: {**b, "modality_inputs": {"images": {"vit": {
        "pixels": b["modality_inputs"]["images"]["vit"]["x"]}}}}))
    assert "['vit'] passes ['pixels'], which the encoder's forward does not take" in wrong_argument


def test_samples_must_follow_the_indices_the_context_gives():
    @mimo.hookimpl
    def data_provider(settings, ctx):  # reads its own counter instead of ctx.sample_indices()
        from mimo.providers.mock_vlm.data import _task, collate, sample

        patterns, captions = _task(settings)
        rows, start = ctx.num_positions or ctx.micro_batch_size, 0
        while True:
            yield collate(settings, [sample(settings, patterns, captions, ctx.seed, start + i) for i in range(rows)])
            start += rows

    assert failure(plugin(data_provider=data_provider)).startswith(
        "data_provider: micro-batch 0: reading lanes 0 and 1 together (num_positions=4) differs from reading each")


@dataclass
class PathSettings:
    root: Path = field(default=Path("/data"))


@dataclass
class RequiredSettings:
    size: int


@pytest.mark.parametrize("settings_class, message", [
    (PathSettings, "settings: 'root' = PosixPath('/data') is a PosixPath; settings must be int, float, bool, str, "
                   "a Literal, None or lists of them"),
    (RequiredSettings, "settings: RequiredSettings fields ['size'] have no default"),
])
def test_settings_must_have_defaults_and_round_trip(settings_class, message):
    @mimo.hookimpl
    def register_providers():
        return [mimo.Provider("mock-vlm", "settings under test", settings_class)]

    @mimo.hookimpl
    def model_shape(settings):
        return {"language": mimo.ModuleShape(1, 8, 1)}

    with pytest.raises(ContractError) as err:
        static_check(plugin(register_providers=register_providers, model_shape=model_shape))
    assert str(err.value).startswith(message)


def test_a_provider_that_is_not_installed_is_named():
    with pytest.raises(ContractError, match=r"register_providers: unknown provider 'no-such-vlm'.*installed\?"):
        check_provider("no-such-vlm", registry=Registry([]))


def test_flops_are_checked_only_when_mimo_has_the_hook(monkeypatch):
    assert "FLOPs not checked: mimo.plugins.hookspecs has no 'model_flops' hook" in static_check(plugin()).notes \
        or "model_flops" in hookspec_signatures()

    @hookspecs.hookspec(firstresult=True)
    def model_flops(settings, seq_length):
        """Training FLOPs of one sample."""

    monkeypatch.setattr(hookspecs, "model_flops", model_flops, raising=False)

    def with_flops(value):
        @mimo.hookimpl
        def model_flops(settings, seq_length):
            return value

        module = plugin()
        module.model_flops = model_flops
        return module

    assert static_check(with_flops({"language": 6.0e9, "images": 1.0e9})).flops == {"language": 6.0e9,
                                                                                     "images": 1.0e9}
    assert failure(with_flops(-1)) == "model_flops: returned -1.0; FLOPs must be positive and finite"
    assert failure(with_flops("many")) == "model_flops: must return a number or {name: number} of FLOPs, got 'many'"
    assert "FLOPs not reported: no implementation of 'model_flops' returned a value" in static_check(plugin()).notes


def test_sample_flops_must_name_model_flops_modules_and_add_up_by_part():
    from mimo.providers.mock_vlm.model import sample_flops as mock_sample_flops

    def with_sample_flops(function):
        module = plugin()
        module.model_flops, module.sample_flops = mock_vlm.model_flops, mimo.hookimpl(function)
        return module

    assert "sample_flops" in static_check(with_sample_flops(
        lambda settings, tokens, image_patches: mock_sample_flops(settings, tokens, image_patches))).hooks_called
    assert failure(with_sample_flops(lambda settings, tokens, image_patches: {"language": float(tokens)})) == (
        "sample_flops: names modules ['language'], model_flops ['images', 'language']")
    # an image that costs more beside tokens than alone: the loop's sum of the parts would miss it
    assert failure(with_sample_flops(lambda settings, tokens, image_patches: {
        "language": float(tokens) * (1 + len(image_patches)), "images": float(sum(image_patches))})).startswith(
        "sample_flops: a sample's FLOPs must be its tokens' and its images' apart (the loop adds them up)")
    assert "sample FLOPs not reported: no implementation of 'sample_flops' returned a value" in \
        static_check(plugin()).notes


# -- a rule only the built model can check, through the worker as a provider's tests run it

MISCOUNT = """
    import mimo
    from mimo.providers import mock_vlm
    from mimo.providers.mock_vlm import build_encoders, build_language_model, model_shape

    @mimo.hookimpl
    def register_providers():
        return [mimo.Provider("miscount-vlm", "moves one image token to the next sample", mock_vlm.MockVLMSettings)]

    @mimo.hookimpl
    def data_provider(settings, ctx):
        for batch in mock_vlm.data_provider(settings, ctx):
            n = settings.image_tokens  # sample 0 gets one placeholder too few, sample 1 one too many
            batch["input_ids"][0, n - 1], batch["input_ids"][1, n] = 1, settings.image_token_id
            yield batch
"""


def test_each_image_needs_as_many_placeholders_as_its_encoder_gives(tmp_path, tmp_target, monkeypatch):
    """The micro-batch's total matches the encoder output, which megatron-core's MimoModel accepts while putting
    an image's embeddings into the other sample; the worker compares each sample with the tokens per image."""
    install_distribution(write_distribution(tmp_path / "miscount", "miscount-vlm", "miscount_vlm", "miscount",
                                            MISCOUNT), tmp_target)
    monkeypatch.setenv("PYTHONPATH", str(tmp_target))
    with pytest.raises(ContractError) as err:
        check_build_and_train("miscount-vlm")
    assert str(err.value) == ("data_provider: sample 0 of micro-batch 0 has 15 'images' placeholder tokens but its "
                              "images give 16 embeddings ([16] per image, in order)")
