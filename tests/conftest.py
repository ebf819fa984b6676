"""Shared fixtures: a fresh registry and a captured observer per test."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvobs.testing import capture


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def cap():
    with capture(engine="test", integrity=None, lock_timeout=2.0) as captured:
        yield captured

