"""What the signal-buffer tests share: a clock the test moves, a logger that records, and the buffer's
metrics read back from a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvobs import semconv as sc
from kvobs.telemetry._metrics.engine_metrics import EngineMetrics
from kvobs.telemetry._metrics.families import MetricFamilies

ENGINE = "test"


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class RecordingLogger:
    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict]] = []

    def _log(self, level: str):
        return lambda event, **kw: self.records.append((level, event, kw))

    def __getattr__(self, level: str):
        return self._log(level)


def make_metrics(engine: str = ENGINE) -> tuple[CollectorRegistry, EngineMetrics]:
    registry = CollectorRegistry()
    return registry, EngineMetrics(MetricFamilies.of(registry), engine=engine, lock_name="cache")


def outcome_count(registry: CollectorRegistry, outcome: str, engine: str = ENGINE) -> float:
    """One scrape of the registry (counts are flushed when the pending gauge is read, before the counter)."""
    return registry.get_sample_value(sc.SIGNALS_TOTAL, {"engine": engine, "outcome": outcome}) or 0.0


def counts(registry: CollectorRegistry, engine: str = ENGINE) -> dict[str, float]:
    """Every outcome's count, from one scrape."""
    found = dict.fromkeys(sc.SIGNAL_OUTCOMES, 0.0)
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == sc.SIGNALS_TOTAL and sample.labels["engine"] == engine:
                found[sample.labels["outcome"]] = sample.value
    return found


def nothing_but(**expected: float) -> dict[str, float]:
    return {**dict.fromkeys(sc.SIGNAL_OUTCOMES, 0.0), **expected}
