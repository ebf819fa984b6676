"""Shared fixtures: a fresh registry and a captured observer per test (one that checks for NaN/Inf too)."""

from __future__ import annotations

import pytest
import structlog
from prometheus_client import CollectorRegistry

from kvobs.testing import capture


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def cap():
    with capture(engine="test", integrity=None, lock_timeout=2.0) as captured:
        yield captured


@pytest.fixture
def checked():
    """A captured observer whose NaN/Inf checks raise CorruptKVError."""
    with capture(engine="checked", integrity="raise", lock_timeout=2.0) as captured:
        yield captured


@pytest.fixture(autouse=True)
def structlog_left_as_found():
    """`structlog.testing.capture_logs` leaves structlog marked configured; undo that, so a later test can still
    check that kvobs itself never configures structlog."""
    was_configured = structlog.is_configured()
    yield
    if not was_configured and structlog.is_configured():
        structlog.reset_defaults()
