"""Span export that is counted when it fails, and a shutdown bounded by the export timeout.

Why: an OTLP exporter that cannot reach its collector only logs through the standard library, so nothing
showed up in kvobs_telemetry_errors_total; and at exit the SDK's batch processor keeps exporting what is
queued, batch after batch, each retried until its own timeout, for up to 30 s. Here every failed export is
counted (stage `export`, engine label "": export belongs to the process, not to one observer) and logged
once per interval; once shutdown starts, what is left gets `timeout_s` in all, then the exporter is shut
down (which aborts its retries) and the remaining batches are counted as failed, not sent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from time import monotonic
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from kvobs.errors import SpanExportFailed
from kvobs.telemetry.failures import STAGE_EXPORT

Failed = Callable[[str, BaseException], None]


class CountingSpanExporter(SpanExporter):
    """Wraps an exporter: a batch that fails (FAILURE or an exception) is reported as `failed("export", exc)`
    and never raised. After `close_within(t)` exports run until the deadline, then the wrapped exporter is
    shut down and later batches fail at once."""

    def __init__(self, exporter: SpanExporter, failed: Failed) -> None:
        self.exporter = exporter
        self._failed = failed
        self._name = type(exporter).__qualname__
        self._deadline: float | None = None
        self._timer: threading.Timer | None = None
        self._shutdown_lock = threading.Lock()
        self._shut_down = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._deadline is not None and monotonic() >= self._deadline:
            self._failed(STAGE_EXPORT, SpanExportFailed(self._name, len(spans), "shutdown timeout reached"))
            return SpanExportResult.FAILURE
        try:
            result = self.exporter.export(spans)
        except Exception as exc:  # noqa: BLE001 - an exporter bug must not reach the span processor's thread
            self._failed(STAGE_EXPORT, exc)
            return SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self._failed(STAGE_EXPORT, SpanExportFailed(self._name, len(spans), f"result {result.name}"))
        return result

    def close_within(self, timeout_s: float) -> None:
        """Shutdown has begun: allow `timeout_s` for what is queued, then shut the exporter down."""
        self._deadline = monotonic() + timeout_s
        self._timer = threading.Timer(timeout_s, self._shutdown_exporter)
        self._timer.daemon = True
        self._timer.start()

    def shutdown(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._shutdown_exporter()

    def _shutdown_exporter(self) -> None:
        with self._shutdown_lock:
            if self._shut_down:
                return
            self._shut_down = True
        try:
            self.exporter.shutdown()
        except Exception as exc:  # noqa: BLE001
            self._failed(STAGE_EXPORT, exc)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


class BoundedBatchSpanProcessor(SpanProcessor):
    """The SDK's BatchSpanProcessor over a CountingSpanExporter, whose shutdown takes at most `timeout_s`
    (plus the time to shut the exporter down) instead of up to 30 s per queue of batches."""

    def __init__(self, exporter: CountingSpanExporter, timeout_s: float, **batch_options: Any) -> None:
        self.exporter = exporter
        self.timeout_s = timeout_s
        batch_options.setdefault("export_timeout_millis", timeout_s * 1000)
        self._batch = BatchSpanProcessor(exporter, **batch_options)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self._batch.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        self._batch.on_end(span)

    def shutdown(self) -> None:
        self.exporter.close_within(self.timeout_s)
        self._batch.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._batch.force_flush(timeout_millis)
