"""A swallowed telemetry failure is counted every time and logged once per kind per interval; never raised."""

from __future__ import annotations

import structlog
from prometheus_client import CollectorRegistry

from kvobs import semconv as sc
from kvobs.telemetry._failures import EVENT_TELEMETRY_FAILED, TelemetryFailures
from kvobs.telemetry._metrics.engine_metrics import EngineMetrics
from kvobs.telemetry._metrics.families import MetricFamilies


def capturing_logger() -> tuple[object, structlog.testing.LogCapture]:
    capture = structlog.testing.LogCapture()
    return structlog.wrap_logger(structlog.PrintLogger(), processors=[capture]), capture


def errors(registry: CollectorRegistry, engine: str, stage: str) -> float:
    return registry.get_sample_value(sc.TELEMETRY_ERRORS_TOTAL, {"engine": engine, "stage": stage}) or 0.0


def test_each_failure_is_counted_and_each_kind_logged_once():
    registry = CollectorRegistry()
    logger, capture = capturing_logger()
    metrics = EngineMetrics(MetricFamilies.of(registry), "fail", "cache", logger=logger)
    for _ in range(100):
        try:
            raise ConnectionError("collector down")
        except Exception:  # noqa: BLE001 - what every kvobs telemetry site does
            metrics.count_telemetry_error("tracing")
    metrics.count_telemetry_error("tracing", KeyError("other kind"))
    metrics.failures("hook", RuntimeError("hook bug"))
    assert errors(registry, "fail", "tracing") == 101
    assert errors(registry, "fail", "hook") == 1
    lines = [(e["stage"], e["error_type"]) for e in capture.entries if e["event"] == EVENT_TELEMETRY_FAILED]
    assert lines == [("tracing", "ConnectionError"), ("tracing", "KeyError"), ("hook", "RuntimeError")]
    first = capture.entries[0]
    assert first["log_level"] == "warning" and first["engine"] == "fail"
    assert isinstance(first["exc_info"], ConnectionError) and str(first["exc_info"]) == "collector down"


def test_a_kind_is_logged_again_after_the_interval_with_what_was_left_out():
    logger, capture = capturing_logger()
    clock = [0.0]
    failures = TelemetryFailures("clock", {}, logger, interval_s=10.0, clock=lambda: clock[0])
    for t in (0.0, 1.0, 2.0, 11.0):
        clock[0] = t
        failures("export", TimeoutError("slow"))
    assert [e.get("suppressed") for e in capture.entries] == [None, 2]


class Broken:
    """A logger that fails on every call."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise OSError("log sink gone")

        return fail


def test_a_failing_logger_never_raises_and_is_counted_as_logging():
    registry = CollectorRegistry()
    metrics = EngineMetrics(MetricFamilies.of(registry), "quiet", "cache", logger=Broken())
    metrics.count_telemetry_error("metrics", ValueError("x"))
    metrics.failures("scrape")  # outside an except block: no exception to show
    assert errors(registry, "quiet", "metrics") == 1
    assert errors(registry, "quiet", "scrape") == 1
    assert errors(registry, "quiet", "logging") == 2


def test_an_unknown_stage_is_still_logged_and_kvobs_never_configures_structlog():
    logger, capture = capturing_logger()
    TelemetryFailures("e", {}, logger)("brand-new-stage", ValueError("y"))
    assert capture.entries[0]["stage"] == "brand-new-stage"
    assert not structlog.is_configured()


class Exploding:
    """An owner whose scrape-time reading raises."""

    def read(self) -> float:
        raise ZeroDivisionError("reader bug")


def test_a_reader_that_raises_shows_zero_and_is_counted_as_scrape():
    registry = CollectorRegistry()
    logger, capture = capturing_logger()
    metrics = EngineMetrics(MetricFamilies.of(registry), "scrape", "cache", logger=logger)
    owner = Exploding()
    metrics.bind_lock_held(owner, Exploding.read)
    assert registry.get_sample_value(sc.LOCK_HELD_SECONDS, {"engine": "scrape", "lock": "cache"}) == 0.0
    assert errors(registry, "scrape", "scrape") == 2  # a scrape shows its own failure: gauges are read first
    assert [e["error_type"] for e in capture.entries] == ["ZeroDivisionError"]


def test_a_record_that_cannot_be_folded_in_is_counted_and_costs_no_other():
    registry = CollectorRegistry()
    logger, capture = capturing_logger()
    metrics = EngineMetrics(MetricFamilies.of(registry), "bad", "cache", logger=logger)
    send = metrics.path(sc.PATH_SEND)
    send.finished("ok", 0.5, 0.0, 0.5, 1, 10, None)
    send.finished("ok", "not a number", 0.0, 0.5, 1, 10, None)
    send.finished("no-such-outcome", 0.5, 0.0, 0.5, 1, 10, None)
    send.finished("ok", 0.5, 0.0, 0.5, -3, 10, None)
    send.finished("error", 0.25, 0.0, 0.25, 1, 10, None)
    labels = {"engine": "bad", "path": "send"}
    assert registry.get_sample_value(sc.TRANSFERS_TOTAL, {**labels, "outcome": "ok"}) == 1
    assert registry.get_sample_value(sc.TRANSFERS_TOTAL, {**labels, "outcome": "error"}) == 1
    assert registry.get_sample_value(sc.TRANSFER_BLOCKS_TOTAL, labels) == 1
    assert registry.get_sample_value(sc.LOCK_WAIT_SECONDS + "_count", {**labels, "lock": "cache"}) == 2
    assert errors(registry, "bad", "metrics") == 3
    assert {e["error_type"] for e in capture.entries} == {"TypeError", "KeyError", "ValueError"}
