"""The demo's tracer provider: spans always record, so the latency histograms' exemplars carry trace ids (the
dashboards' trace links) with no collector at all; with an OTLP endpoint they are exported as well."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import kvobs

SERVICE_NAME = "kvobs-demo"
FLUSH_S = 2.0


def otlp_endpoint(explicit: str | None) -> str | None:
    """--otlp-endpoint, else the standard OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT unless OTEL_TRACES_EXPORTER=none."""
    if explicit:
        return explicit
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")


@dataclass
class DemoTracing:
    """An SDK TracerProvider (never the global one); when exporting, kvobs's own (`kvobs.configure_tracing`),
    whose flush and shutdown are bounded even with the collector down."""

    provider: Any
    endpoint: str | None = None

    @classmethod
    def start(cls, endpoint: str | None) -> DemoTracing:
        from opentelemetry.sdk.resources import SERVICE_NAME as SERVICE_NAME_KEY
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        service = os.environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME
        if not endpoint:  # recorded in-process, then dropped: no span processor, nothing exported
            return cls(TracerProvider(resource=Resource.create({SERVICE_NAME_KEY: service})))
        # Each export, and the shutdown's export of what is queued, waits at most FLUSH_S: the demo ends
        # promptly whether or not a collector answers.
        provider = kvobs.configure_tracing(service, endpoint=endpoint, timeout=FLUSH_S, set_global=False)
        return cls(provider, endpoint)

    def describe(self) -> str:
        return f"traces: OTLP to {self.endpoint}" if self.endpoint else "traces: recorded in-process, not exported"

    def shutdown(self) -> None:
        """Export what is queued (within FLUSH_S), then stop."""
        try:
            self.provider.shutdown()
        except Exception:  # noqa: BLE001 - an unreachable collector must not fail the demo
            pass
