"""Reading micro-batches ahead: same items in the same order, errors where they happened, stateful loaders left
alone."""

import pytest
import torch

from mimo.core.run.prefetch import Prefetcher, read_ahead
from mimo.plugins import DataSource
from mimo.plugins.data_source import as_data_source


def test_items_come_in_order_and_the_end_is_final():
    reader = Prefetcher(iter(range(20)), depth=3)
    assert list(reader) == list(range(20))
    with pytest.raises(StopIteration):
        next(reader)


def test_an_error_surfaces_after_the_items_before_it():
    def produce():
        yield 1
        yield 2
        raise ValueError("bad sample 3")

    reader = Prefetcher(produce(), depth=2)
    assert next(reader) == 1 and next(reader) == 2
    with pytest.raises(ValueError, match="bad sample 3"):
        next(reader)


def test_resumable_sources_and_depth_zero_are_not_read_ahead():
    class Resumable(DataSource):
        resumable = True

        def __next__(self):
            return 0

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    loader = Resumable()
    assert read_ahead(loader, 2, torch.device("cpu")) is loader
    plain = as_data_source(iter([1, 2]))
    assert read_ahead(plain, 0, torch.device("cpu")) is plain
    reader = read_ahead(as_data_source(iter([1])), 2, torch.device("cpu"))
    assert isinstance(reader, Prefetcher) and isinstance(reader, DataSource) and list(reader) == [1]


def test_close_stops_the_thread_and_closes_the_source():
    closed = []

    def forever():
        try:
            while True:
                yield torch.zeros(2)
        finally:
            closed.append(True)

    reader = Prefetcher(forever(), depth=2)
    next(reader)
    reader.close()
    reader._thread.join(timeout=10)
    assert not reader._thread.is_alive() and closed == [True]
