"""The demo's tracer provider: spans always record, so the latency histograms' exemplars carry trace ids (the
dashboards' trace links) with no collector at all; with an OTLP endpoint they are exported as well."""

from __future__ import annotations

import os
import threading
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
    """An SDK TracerProvider (never the global one) and, when exporting, its exporter (kept for a bounded
    shutdown)."""

    provider: Any
    endpoint: str | None = None
    exporter: Any = None

    @classmethod
    def start(cls, endpoint: str | None) -> DemoTracing:
        from opentelemetry.sdk.resources import SERVICE_NAME as SERVICE_NAME_KEY
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        service = os.environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME
        if not endpoint:  # recorded in-process, then dropped: no span processor, nothing exported
            return cls(TracerProvider(resource=Resource.create({SERVICE_NAME_KEY: service})))
        from kvobs.telemetry.tracing import otlp_exporter

        exporter = otlp_exporter(endpoint=endpoint)
        provider = kvobs.configure_tracing(service, exporter=exporter, set_global=False)
        return cls(provider, endpoint, exporter)

    def describe(self) -> str:
        return f"traces: OTLP to {self.endpoint}" if self.endpoint else "traces: recorded in-process, not exported"

    def shutdown(self, flush_s: float = FLUSH_S) -> None:
        """Flush for at most `flush_s`, then stop. The SDK's BatchSpanProcessor ignores force_flush's timeout,
        and with the collector down its export retries for up to the exporter's timeout: flush on a helper
        thread, and shut the exporter down first, which ends any retry in progress."""
        try:
            flusher = threading.Thread(target=self.provider.force_flush, name="kvobs-demo-flush", daemon=True)
            flusher.start()
            flusher.join(flush_s)
            if self.exporter is not None:
                self.exporter.shutdown()
            self.provider.shutdown()
        except Exception:  # noqa: BLE001 - an unreachable collector must not fail the demo
            pass
