"""Shared fixtures."""

import pytest


@pytest.fixture
def tmp_target(tmp_path):
    target = tmp_path / "site"
    target.mkdir()
    return target
