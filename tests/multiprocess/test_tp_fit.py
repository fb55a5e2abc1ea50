"""A colocated layout whose TP does not divide the ranks is refused for that, naming the TPs that fit, before any
suggestion about the encoders' TP (which would only be refused next)."""

from __future__ import annotations

import pytest

from mimo.core.config import LaunchOptions, LayoutOptions, RunConfig
from mimo.core.run.plan import prepare
from mimo.errors import UsageError


@pytest.mark.parametrize("layout", [{"llm_tp": 3}, {"llm_tp": 3, "encoder_tp": 3}])
def test_a_colocated_tp_that_does_not_fit_the_ranks_says_so(layout):
    config = RunConfig(provider="mock-vlm", launch=LaunchOptions(nproc_per_node=2), layout=LayoutOptions(**layout))
    with pytest.raises(UsageError) as err:
        prepare(config, world_size=2)
    message = str(err.value)
    assert message.startswith("--llm-tp 3 does not fit 2 ranks") and "among 1, 2" in message
    assert "--encoder-tp 3" not in message
