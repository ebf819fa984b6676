"""Capture the spans, metric values and logs that kvobs records, for users' own tests.

    from kvobs.testing import capture

    with capture(engine="test") as cap:
        @cap.observer.write_back(block_ids="ids")
        def write(ids): ...
        write([1, 2])
    assert cap.value("kvobs_transfers_total", path="write_back", outcome="ok") == 1
    assert cap.spans[0].name == "kvobs.write_back"

Nothing global is touched: the observer gets its own registry, tracer provider and logger.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import structlog
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from kvobs import semconv as sc
from kvobs.observer import KVObserver


@dataclass
class Captured:
    """What one `capture()` block recorded."""

    observer: KVObserver
    registry: CollectorRegistry
    exporter: InMemorySpanExporter
    log_capture: structlog.testing.LogCapture
    provider: TracerProvider

    @property
    def spans(self) -> tuple[ReadableSpan, ...]:
        """Finished spans, in the order they ended."""
        return self.exporter.get_finished_spans()

    @property
    def logs(self) -> list[dict[str, Any]]:
        """Every event kvobs logged, as structlog event dicts (debug included)."""
        return self.log_capture.entries

    def value(self, name: str, **labels: str) -> float | None:
        """A sample's value; `engine` defaults to the observer's. None when the series does not exist."""
        labels.setdefault(sc.LABEL_ENGINE, self.observer.engine)
        return self.registry.get_sample_value(name, labels)


@contextmanager
def capture(engine: str = "test", **observer_options: Any) -> Iterator[Captured]:
    """A KVObserver wired to in-memory telemetry; options are passed to KVObserver. A `tracer_provider` given
    (an SDK TracerProvider) gets the in-memory exporter added, and is left running afterwards."""
    registry = observer_options.pop("registry", None) or CollectorRegistry()
    exporter = InMemorySpanExporter()
    given = observer_options.pop("tracer_provider", None)
    provider = given if given is not None else TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    log_capture = structlog.testing.LogCapture()
    logger = structlog.wrap_logger(structlog.PrintLogger(), processors=[log_capture])
    observer_options.setdefault("log_level", "debug")
    observer = KVObserver(
        engine, registry=registry, tracer_provider=provider, logger=logger, **observer_options
    )
    try:
        yield Captured(observer, registry, exporter, log_capture, provider)
    finally:
        if given is None:
            provider.shutdown()
