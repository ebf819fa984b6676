"""Span export that is counted when it fails, a flush and a shutdown bounded by their timeouts.

Why: an OTLP exporter that cannot reach its collector only logs through the standard library, so nothing
showed up in kvobs_telemetry_errors_total; the SDK's batch processor drops spans from its full queue
uncounted, its force_flush ignores its timeout and always says True, and at exit it keeps exporting what is
queued, batch after batch, each retried until its own timeout, for up to 30 s. Here every failed export and
every dropped span is counted (stage `export`, engine label "": export belongs to the process, not to one
observer) and logged once per interval; a flush returns within its timeout, saying whether everything got
out; once shutdown starts, what is left gets `timeout_s` in all, then the exporter is shut down (which
aborts its retries) and what remains is counted as failed, not sent.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Sequence
from time import monotonic

from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, Context, attach, detach, set_value
from opentelemetry.sdk.environment_variables import (
    OTEL_BSP_MAX_EXPORT_BATCH_SIZE,
    OTEL_BSP_MAX_QUEUE_SIZE,
    OTEL_BSP_SCHEDULE_DELAY,
)
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvobs._runtime.forks import renewed_after_fork
from kvobs.errors import SpanExportFailed
from kvobs.telemetry._failures import STAGE_EXPORT, Failed

# the SDK's defaults for its OTEL_BSP_* variables (documented in the OpenTelemetry specification)
_DEFAULT_MAX_QUEUE_SIZE = 2048
_DEFAULT_MAX_EXPORT_BATCH_SIZE = 512
_DEFAULT_SCHEDULE_DELAY_MS = 5000


class CountingSpanExporter(SpanExporter):
    """Wraps an exporter: a batch that fails (FAILURE or an exception) is reported as `failed("export", exc)`
    and never raised. After `close_within(t)` exports run until the deadline, then the wrapped exporter is
    shut down and later batches fail at once."""

    def __init__(self, exporter: SpanExporter, failed: Failed) -> None:
        self.exporter = exporter
        self._failed = failed
        self.name = type(exporter).__qualname__
        self._deadline: float | None = None
        self._timer: threading.Timer | None = None
        self._shutdown_lock = threading.Lock()
        self._shut_down = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._deadline is not None and monotonic() >= self._deadline:
            self._failed(STAGE_EXPORT, SpanExportFailed(self.name, len(spans), "shutdown timeout reached"))
            return SpanExportResult.FAILURE
        try:
            result = self.exporter.export(spans)
        except Exception as exc:  # noqa: BLE001 - an exporter bug must not reach the span processor's thread
            self._failed(STAGE_EXPORT, exc)
            return SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self._failed(STAGE_EXPORT, SpanExportFailed(self.name, len(spans), f"result {result.name}"))
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
    """Batches ended spans to a CountingSpanExporter on a thread of its own, with three bounds the SDK's
    BatchSpanProcessor lacks: a span dropped because the queue is full is counted (stage `export`) and logged
    once per interval; `force_flush(timeout_millis)` returns within its timeout, True only when every span
    ended before it was exported; `shutdown()` takes at most `timeout_s` (plus shutting the exporter down).

    Why not the SDK's: it drops spans from a full queue with a log line and no count, and its force_flush
    ignores its timeout, exports the whole queue batch after batch (each retried until the exporter's own
    timeout) and returns True whatever happened (with the collector down, see docs/benchmarks.md). Sizes
    come from the SDK's OTEL_BSP_* variables.
    """

    def __init__(self, exporter: CountingSpanExporter, timeout_s: float, failed: Failed, *,
                 max_queue_size: int | None = None, max_export_batch_size: int | None = None,
                 schedule_delay_millis: float | None = None) -> None:
        self.exporter = exporter
        self.timeout_s = timeout_s
        self._failed = failed
        self.max_queue_size = _size(max_queue_size, OTEL_BSP_MAX_QUEUE_SIZE, _DEFAULT_MAX_QUEUE_SIZE)
        self.max_export_batch_size = min(self.max_queue_size, _size(
            max_export_batch_size, OTEL_BSP_MAX_EXPORT_BATCH_SIZE, _DEFAULT_MAX_EXPORT_BATCH_SIZE))
        self._delay_s = _size(schedule_delay_millis, OTEL_BSP_SCHEDULE_DELAY, _DEFAULT_SCHEDULE_DELAY_MS) / 1000
        self._renew()
        _renewed_after_fork.add(self)

    def _renew(self) -> None:
        """A fresh queue, lock and counts: at creation, and in a forked child (the parent's spans are the
        parent's to export, and its worker thread did not come along)."""
        self._queue: deque[ReadableSpan] = deque()
        self._changed = threading.Condition(threading.Lock())
        self._accepted = 0  # spans queued so far
        self._finished = 0  # of those, spans whose export ended (exported or not)
        self._lost = 0  # of those, spans not exported
        self._flush_to = 0  # export now, without waiting for a full batch, until `_finished` reaches this
        self._stopping = False
        self._worker: threading.Thread | None = None

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if not span.context.trace_flags.sampled:
            return
        with self._changed:
            if self._stopping:
                return
            if len(self._queue) >= self.max_queue_size:
                dropped = True
            else:
                dropped = False
                self._queue.append(span)
                self._accepted += 1
                if self._worker is None:
                    self._start_worker()
                if len(self._queue) == self.max_export_batch_size:
                    self._changed.notify_all()
        if dropped:
            self._failed(STAGE_EXPORT, SpanExportFailed(
                self.exporter.name, 1, f"the queue is full ({self.max_queue_size} spans wait for the exporter)"))

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export what is queued now; True when all of it was exported within `timeout_millis`."""
        deadline = monotonic() + timeout_millis / 1000
        with self._changed:
            target = self._accepted
            lost_before = self._lost
            self._flush_to = max(self._flush_to, target)
            self._changed.notify_all()
            while self._finished < target:
                remaining = deadline - monotonic()
                if remaining <= 0 or self._worker is None:
                    return False
                self._changed.wait(remaining)
            return self._lost == lost_before

    def shutdown(self) -> None:
        """Export what is queued within `timeout_s`, then shut the exporter down; what is left is counted."""
        self.exporter.close_within(self.timeout_s)
        with self._changed:
            self._stopping = True
            self._flush_to = self._accepted
            worker = self._worker
            self._changed.notify_all()
        if worker is not None:
            worker.join(self.timeout_s)
        with self._changed:
            left = len(self._queue)
            self._queue.clear()
        if left:
            self._failed(STAGE_EXPORT, SpanExportFailed(self.exporter.name, left, "shutdown timeout reached"))
        self.exporter.shutdown()

    def _start_worker(self) -> None:
        self._worker = threading.Thread(target=self._run, name="kvobs-span-export", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        while True:
            with self._changed:
                batch = self._next_batch_locked()
                if batch is None:
                    return
            exported = self._export(batch)
            with self._changed:
                self._finished += len(batch)
                if not exported:
                    self._lost += len(batch)
                self._changed.notify_all()

    def _next_batch_locked(self) -> list[ReadableSpan] | None:
        """Wait for a full batch, the schedule delay, a flush or shutdown; None once stopped and empty."""
        due = monotonic() + self._delay_s
        while not self._ready_locked():
            remaining = due - monotonic()
            if remaining <= 0:
                break
            self._changed.wait(remaining)
        if not self._queue:
            return None if self._stopping else []
        size = min(self.max_export_batch_size, len(self._queue))
        return [self._queue.popleft() for _ in range(size)]

    def _ready_locked(self) -> bool:
        return (len(self._queue) >= self.max_export_batch_size or self._stopping
                or (self._queue and self._finished < self._flush_to))

    def _export(self, batch: list[ReadableSpan]) -> bool:
        if not batch:
            return True
        token = attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))  # the exporter's own calls untraced
        try:
            return self.exporter.export(batch) is SpanExportResult.SUCCESS
        finally:
            detach(token)


def _size(given: float | None, variable: str, default: int) -> int:
    """`given`, else the SDK's variable (a positive integer), else its default."""
    if given is not None:
        value = int(given)
    else:
        try:
            value = int(os.environ.get(variable, default))
        except ValueError:
            value = default
    if value <= 0:
        raise ValueError(f"{variable} must be a positive integer, got {value}")
    return value


_renewed_after_fork = renewed_after_fork(BoundedBatchSpanProcessor._renew)
