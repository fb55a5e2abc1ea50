"""The data source contract (mimo.plugins.DataSource): what the loop makes of data_provider's value, and the
contract kit's one-line refusal naming the member missing or wrong."""

import pytest

import mimo
from mimo.errors import UsageError
from mimo.plugins import DataSource, Registry
from mimo.plugins.data_source import MEMBERS, IteratorSource, as_data_source
from mimo.providers import mock_vlm
from mimo.testing import ContractError, check_capabilities, check_data_source, check_provider

HOOKS = ("register_providers", "model_shape", "build_encoders", "build_language_model", "data_provider",
         "frozen_parameters")


class Counting(DataSource):
    """A subclass that overrides nothing but __next__: every capability is the default."""

    def __init__(self):
        self.n = 0

    def __next__(self):
        self.n += 1
        return {"n": self.n}


def test_a_subclass_gets_every_default():
    source = Counting()
    assert iter(source) is source and next(source) == {"n": 1}
    assert (source.resumable, source.hold_data_errors, source.data_error, source.longest_needed) == (
        False, False, None, 0)
    assert source.state_dict() is None and source.data_counts() is None and source.size_note() is None
    assert source.take_skip_records() == [] and source.mark_boundary() is None and source.close() is None
    with pytest.raises(UsageError, match="keeps no data state"):
        source.load_state_dict({})
    assert as_data_source(source) is source
    check_capabilities(check_data_source(source))


def test_a_class_with_every_member_is_a_data_source_without_subclassing():
    from mimo.data import LaneLoader

    assert issubclass(LaneLoader, DataSource) and LaneLoader.resumable
    namespace = {name: (lambda self, *a: None) for name in MEMBERS}
    namespace.update(resumable=False, hold_data_errors=False, data_error=None, longest_needed=0)
    assert issubclass(type("Full", (), namespace), DataSource)
    del namespace["size_note"]
    assert not issubclass(type("Partial", (), namespace), DataSource)


def test_a_plain_generator_is_wrapped_and_closed():
    closed = []

    def batches():
        try:
            while True:
                yield {"x": 1}
        finally:
            closed.append(True)

    source = as_data_source(batches())
    assert isinstance(source, IteratorSource) and next(source) == {"x": 1} and not source.resumable
    source.close()
    assert closed == [True]
    assert next(as_data_source([{"a": 1}])) == {"a": 1}  # any iterable


def test_an_iterator_with_the_former_duck_typed_members_is_refused():
    class Former:  # what DataContext's docstring described before DataSource
        def __iter__(self):
            return self

        def __next__(self):
            return {}

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    with pytest.raises(UsageError, match=r"returned Former, which has state_dict, load_state_dict but is not a "
                                         r"mimo.plugins.DataSource: subclass DataSource"):
        as_data_source(Former(), "x")
    with pytest.raises(UsageError, match="returned int: it must return an iterator"):
        as_data_source(3)


def kit_failure(source) -> str:
    with pytest.raises(ContractError) as err:
        check_capabilities(check_data_source(source))
    assert len(str(err.value).splitlines()) == 1
    return str(err.value)


def test_the_kit_names_the_member_missing_or_wrong():
    class HalfResumable(Counting):
        resumable = True

        def state_dict(self):
            return {"n": self.n}

    assert "HalfResumable.resumable is True but load_state_dict is DataSource's default" in kit_failure(
        HalfResumable())

    class Unsaved(Counting):
        def state_dict(self):
            return {"n": self.n}

    assert "Unsaved overrides state_dict but resumable is False" in kit_failure(Unsaved())

    class NoClose(Counting):
        close = None

    assert "NoClose.close must be a method, got NoneType" in kit_failure(NoClose())

    class DictCounts(Counting):
        def data_counts(self):
            return {"samples": 1}

    assert "DictCounts.data_counts() must return a mimo.data.DataCounts or None, got dict" in kit_failure(
        DictCounts())

    class Lengthy(Counting):
        longest_needed = 1.5

    assert "Lengthy.longest_needed must be int, got float" in kit_failure(Lengthy())


def plugin(data_provider):
    import types

    module = types.ModuleType("source_vlm")
    for hook in HOOKS:
        setattr(module, hook, getattr(mock_vlm, hook))
    module.data_provider = data_provider
    return module


def static_check(module):
    return check_provider("mock-vlm", (), registry=Registry([("src", "source-vlm 1.0", lambda: module)]),
                          build=False)


def test_the_contract_check_refuses_a_provider_whose_source_breaks_the_contract():
    class Batches(DataSource):
        resumable = True  # claims a state it cannot give back

        def __init__(self, inner):
            self.inner = inner

        def __next__(self):
            return next(self.inner)

    @mimo.hookimpl
    def data_provider(settings, ctx):
        return Batches(iter(mock_vlm.data_provider(settings, ctx)))

    with pytest.raises(ContractError) as err:
        static_check(plugin(data_provider))
    assert str(err.value).startswith("data_provider: its DataSource: Batches.resumable is True but state_dict and "
                                     "load_state_dict are DataSource's default")


def test_a_provider_returning_a_subclass_passes_the_contract_check():
    class Batches(DataSource):
        def __init__(self, inner):
            self.inner = inner

        def __next__(self):
            return next(self.inner)

        def close(self):
            self.inner.close()

    @mimo.hookimpl
    def data_provider(settings, ctx):
        inner = mock_vlm.data_provider(settings, ctx)
        return inner if ctx.data_path else Batches(inner)  # --data: the lane loader, a DataSource by structure

    assert "data_provider" in static_check(plugin(data_provider)).hooks_called
