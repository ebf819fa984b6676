"""What the transfer lifecycle reports, turned into metrics, spans, logs and hook calls.

The lifecycle calls one method per transition that matters (rejected, timed out, conflict, checked, ended);
this layer never calls back into it, and never raises into the engine: a failing exporter, metric, logger
or hook is counted (and logged once) instead. Attribute work happens only for a span that records, and log
formatting only at a level that is emitted. Warnings (refused, timed out, abandoned) come in floods when
something upstream breaks: each kind is written once per LOG_INTERVAL_S with the count left out before it,
while the metrics count every one.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanContext, Status, StatusCode

from kvobs import semconv as sc
from kvobs.telemetry._failures import STAGE_LOGGING
from kvobs.telemetry._logs import trace_fields
from kvobs.telemetry._ratelimit import RateLimitedLog
from kvobs.telemetry._tracing import TracerSource

MAX_IDS_ON_SPAN = 64
LOG_INTERVAL_S = 10.0  # per kind of warning line (event, outcome), as the signal buffers' drops
_LEVEL = {
    sc.OUTCOME_OK: logging.DEBUG,
    sc.OUTCOME_REJECTED: logging.WARNING,
    sc.OUTCOME_TIMEOUT: logging.WARNING,
    sc.OUTCOME_ABANDONED: logging.WARNING,
    sc.OUTCOME_ERROR: logging.ERROR,
}


@dataclass(frozen=True)
class TransferRecord:
    """What one transfer did, handed to the observer's hooks once it ended, whatever the outcome."""

    engine: str
    path: str
    outcome: str
    duration_s: float
    lock_wait_s: float
    lock_hold_s: float
    blocks: int
    bytes: int
    error: BaseException | None
    bad_block_ids: tuple[int, ...]
    request_id: Any = None
    key: Any = None


class Ended(Protocol):
    """The view of a transfer this layer reads (the lifecycle's Transfer provides it)."""

    path: str
    outcome: str | None
    request_id: Any
    key: Any
    keys: Any
    nbytes: int | None
    error: BaseException | None
    bad_block_ids: tuple[int, ...]
    span: Any
    trace_context: Any  # a carrier from another node: {"traceparent": ..., "tracestate": ...}
    t_begin: float
    t_acquired: float
    t_end: float
    blocks: Any  # kvobs._lifecycle.validation.Blocks | None
    reported_moved: Any  # the Blocks that completion said moved, or None
    requests: dict[Any, int] | None  # a batch: request id -> its block count
    request_blocks: Any  # a batch: request id -> its block ids, as given


Hook = Callable[[TransferRecord], None]


class Recorder:
    """Telemetry for one (engine, path or lock holder). `metrics` is None when telemetry is disabled (hooks
    still run); `holder=True` records lock wait and hold only, as a holder that is not a transfer."""

    def __init__(
        self,
        engine: str,
        path: str,
        *,
        metrics: Any,
        tracer_source: TracerSource | None,
        logger: Any,
        log_level: int,
        hooks: Iterable[Hook],
        failures: Callable[[str, BaseException], None],
        lock_name: str,
        block_bytes: int | None = None,
        holder: bool = False,
    ) -> None:
        self.engine = engine
        self.path = path
        self.metrics = metrics
        self.tracer_source = tracer_source if metrics is not None else None
        self.logger = logger
        self.log_level = log_level if metrics is not None else logging.CRITICAL + 1
        self._warnings = RateLimitedLog(logger, LOG_INTERVAL_S, on_error=functools.partial(failures, STAGE_LOGGING))
        self.hooks = tuple(hooks)
        self.failed = failures
        self.holder = holder
        self.traces = self.tracer_source is not None and not holder
        self.block_bytes = block_bytes or 0
        self._may_log = self.log_level <= max(_LEVEL.values())
        # nothing to record at an end without a span: telemetry off and no hook
        self._records_nothing = metrics is None and not self.hooks and not self._may_log
        # an ok transfer without a span then only counts: no hook, no log line, not a lock holder
        self._ok_counts_only = (metrics is not None and not self.hooks and not holder
                                and _LEVEL[sc.OUTCOME_OK] < self.log_level)
        self.lock_name = lock_name
        self.span_name = sc.span_name(path)
        self._static = {sc.ATTR_ENGINE: engine, sc.ATTR_PATH: path, sc.ATTR_LOCK_NAME: lock_name}

    # -- spans ------------------------------------------------------------------------------------------

    def start_span(self, t: Ended, context: Any = None) -> Any:
        """A span for the transfer (not made current), or None when nothing traces. With a W3C trace context
        carried from another node (`t.trace_context`), the span continues that trace. `context`: the current otel
        Context when the caller has it (the fast path reads it once, for the SDK's parent and sampler lookups
        and for making the span current); None: the SDK reads it, once per lookup."""
        try:
            tracer = self.tracer_source.get()
            if tracer is None:
                return None
            parent = propagate.extract(t.trace_context, context) if t.trace_context else context
            span = tracer.start_span(self.span_name, context=parent, attributes=self._static)
            if span.is_recording():
                attributes = self._start_attributes(t)
                if attributes:
                    span.set_attributes(attributes)
            return span
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks the engine
            self.failed("tracing", exc)
            return None

    def _start_attributes(self, t: Ended) -> dict[str, Any]:
        attrs: dict[str, Any] = {}
        if t.blocks is not None:
            attrs[sc.ATTR_BLOCKS] = t.blocks.count
            attrs[sc.ATTR_BLOCK_IDS] = t.blocks.ids[:MAX_IDS_ON_SPAN]
        if t.keys is not None:
            attrs[sc.ATTR_KEYS] = [str(k) for k in t.keys[:MAX_IDS_ON_SPAN]]
        if t.request_id is not None:
            attrs[sc.ATTR_REQUEST_ID] = str(t.request_id)
        if t.requests:
            attrs[sc.ATTR_REQUEST_IDS] = [str(r) for r in list(t.requests)[:MAX_IDS_ON_SPAN]]
        return attrs

    def carrier(self, span: Any) -> dict[str, str]:
        """The W3C trace context (`traceparent`, `tracestate`) of `span`, to travel with a transfer's metadata
        to the node that receives it; empty when nothing traces."""
        carrier: dict[str, str] = {}
        if span is None:
            return carrier
        try:
            propagate.inject(carrier, context=trace.set_span_in_context(span))
        except Exception as exc:  # noqa: BLE001
            self.failed("tracing", exc)
        return carrier

    # -- transitions ------------------------------------------------------------------------------------

    def rejected(self, t: Ended) -> None:
        if self.metrics is not None:
            try:
                self.metrics.rejected()
            except Exception as exc:  # noqa: BLE001
                self.failed("metrics", exc)
        self._log(logging.WARNING, "kvobs._lifecycle.transfer.rejected", t, None, reason=_describe(t.error))
        if self.hooks:
            self._hooks(t, [(t.request_id, 0, 0)])

    def timed_out(self, t: Ended) -> None:
        waited = t.t_acquired - t.t_begin
        if self.metrics is not None:
            try:
                if self.holder:
                    self.metrics.timed_out(waited)
                else:
                    self.metrics.timed_out(waited, None if t.span is None else self._exemplar(t.span))
            except Exception as exc:  # noqa: BLE001
                self.failed("metrics", exc)
        span = t.span
        self._end_span(t)
        self._log(logging.WARNING, "kvobs.lock.timeout", t, span, lock=self.lock_name, waited_s=waited)
        if self.hooks:
            self._hooks(t, [(t.request_id, 0, 0)])

    def conflicted(self, holder_path: str) -> None:
        if self.metrics is not None:
            try:
                self.metrics.conflicted(holder_path)
            except Exception as exc:  # noqa: BLE001
                self.failed("metrics", exc)

    def checked(self, t: Ended, result: Any, policy: str) -> None:
        """One NaN/Inf check (`result` None: clean); a finding also becomes a span event and an error log."""
        if self.metrics is not None:
            try:
                if result is None:
                    self.metrics.checked(sc.CHECK_CLEAN, 0)
                else:
                    self.metrics.checked(result.result, len(result.bad_block_ids))
            except Exception as exc:  # noqa: BLE001
                self.failed("metrics", exc)
        if result is None or result.clean:
            return
        bad = list(result.bad_block_ids[:MAX_IDS_ON_SPAN])
        if t.span is not None:
            try:
                t.span.add_event(sc.EVENT_INTEGRITY_BAD_BLOCKS, {sc.ATTR_BAD_BLOCK_IDS: bad})
                # on the span itself too, and an error status: a search for failed transfers finds it whatever
                # the policy then did with the data
                t.span.set_attribute(sc.ATTR_BAD_BLOCK_IDS, bad)
                t.span.set_status(Status(StatusCode.ERROR, f"{result.result} in {len(result.bad_block_ids)} block(s)"))
            except Exception as exc:  # noqa: BLE001
                self.failed("tracing", exc)
        self._log(logging.ERROR, "kvobs.integrity.bad_blocks", t, t.span, result=result.result,
                  bad_blocks=len(result.bad_block_ids), bad_block_ids=bad, policy=policy)

    def ended(self, t: Ended) -> None:
        """The transfer is over (ok, error or abandoned): one record of everything. Written flat: every
        guarded call ends here."""
        span = t.span
        if span is None and self._ok_counts_only and t.outcome == sc.OUTCOME_OK and not t.requests:
            # ok, and only metrics record it (no span, hook, log line or batch): its one `finished()`, worked out as
            # below. A transfer that took its lock at once (every one on the fast path) waited nothing and held it
            # for its whole duration: no subtraction for either.
            try:
                begin = t.t_begin
                acquired = t.t_acquired
                end = t.t_end
                duration = end - begin
                if acquired == begin:
                    wait = 0.0
                    hold = duration
                else:
                    wait = acquired - begin
                    hold = end - acquired if end > acquired else 0.0
                counted = t.reported_moved
                if counted is None:
                    counted = t.blocks
                blocks = 0 if counted is None else counted.count
                nbytes = t.nbytes
                if nbytes is None:
                    nbytes = blocks * self.block_bytes
                self.metrics.finished(sc.OUTCOME_OK, duration, wait, hold, blocks, nbytes, None)
            except Exception as exc:  # noqa: BLE001 - whatever this layer gets wrong, the engine's call is unaffected
                self.failed("metrics", exc)
            return
        if span is None and self._records_nothing:
            return
        try:
            acquired = t.t_acquired
            if acquired:  # _timings, inlined
                begin = t.t_begin
                end = t.t_end
                duration = end - begin
                wait = acquired - begin
                hold = end - acquired if end > acquired else 0.0
            else:
                duration, wait, hold = _ZEROS
            moved = None
            if t.requests:
                moved = self._moved(t)
                blocks = t.blocks.count
                nbytes = sum(map(_THIRD, moved))
            else:
                counted = t.reported_moved
                if counted is None:
                    counted = t.blocks
                blocks = 0 if counted is None else counted.count
                nbytes = t.nbytes
                if nbytes is None:
                    nbytes = blocks * self.block_bytes
            metrics = self.metrics
            if metrics is not None:
                try:
                    if self.holder:
                        metrics.held(wait, hold, None)
                    elif moved is None:
                        metrics.finished(t.outcome, duration, wait, hold, blocks, nbytes,
                                         None if span is None else self._exemplar(span))
                    else:
                        metrics.finished_many(t.outcome, duration, wait, hold, moved,  # one per request
                                              None if span is None else self._exemplar(span))
                except Exception as exc:  # noqa: BLE001
                    self.failed("metrics", exc)
            if span is not None:
                t.span = None
                self._close_span(span, t.outcome, t.error, (wait, hold, nbytes))
            level = _LEVEL.get(t.outcome, logging.ERROR) if self._may_log else logging.NOTSET
            if level >= self.log_level:
                self._log(level, "kvobs._lifecycle.transfer", t, span, outcome=t.outcome, blocks=blocks, duration_s=duration,
                          lock_wait_s=wait, lock_hold_s=hold, error=_describe(t.error))
            if self.hooks:
                self._hooks(t, moved or [(t.request_id, blocks, nbytes)])
        except Exception as exc:  # noqa: BLE001 - whatever this layer gets wrong, the engine's call is unaffected
            self.failed("metrics", exc)

    # -- helpers ----------------------------------------------------------------------------------------

    def _exemplar(self, span: Any) -> SpanContext | None:
        """The span context a recording span's exemplar is formatted from, when scraped (`ExemplarSource`)."""
        try:
            if not span.is_recording():
                return None
            context = span.get_span_context()
            return context if context.is_valid else None
        except Exception as exc:  # noqa: BLE001
            self.failed("tracing", exc)
            return None

    def _end_span(self, t: Ended) -> None:
        """End the transfer's span, if it has one not yet ended, as its outcome says."""
        span = t.span
        if span is not None:
            t.span = None
            self._close_span(span, t.outcome, t.error)

    def _close_span(self, span: Any, outcome: str | None, error: BaseException | None,
                    ended: tuple[float, float, int] | None = None) -> None:
        """On a span that records (attributes are built only then): the end's lock wait, hold and bytes
        (`ended`) with the outcome, error status and `error.type` on failure or abandonment; always end it. The
        exception's text is read defensively (its __str__ or __repr__ may raise)."""
        try:
            if span.is_recording():
                if ended is not None:
                    wait, hold, nbytes = ended
                    span.set_attributes({sc.ATTR_LOCK_WAIT_S: wait, sc.ATTR_LOCK_HOLD_S: hold,
                                         sc.ATTR_OUTCOME: outcome, sc.ATTR_BYTES: nbytes})
                if error is not None:
                    span.set_attribute(sc.ATTR_ERROR_TYPE, type(error).__qualname__)
                    span.set_status(Status(StatusCode.ERROR, _describe(error)))
                    span.record_exception(error)
                elif outcome == sc.OUTCOME_ABANDONED:
                    span.set_attribute(sc.ATTR_ERROR_TYPE, sc.OUTCOME_ABANDONED)
                    span.set_status(Status(StatusCode.ERROR, "never completed before its deadline"))
        except Exception as exc:  # noqa: BLE001
            self.failed("tracing", exc)
        finally:
            try:
                span.end()
            except Exception as exc:  # noqa: BLE001
                self.failed("tracing", exc)

    def _log(self, level: int, event: str, t: Ended, span: Any, **fields: Any) -> None:
        if level < self.log_level:
            return
        try:
            if span is not None:
                fields.update(trace_fields(span))
            if t.request_id is not None:
                fields["request_id"] = t.request_id
            if t.key is not None:
                fields["key"] = t.key
            method = logging.getLevelName(level).lower()
            if level == logging.WARNING:
                self._warnings.log((event, fields.get("outcome")), method, event, engine=self.engine, path=self.path,
                                   **fields)
            else:
                getattr(self.logger, method)(event, engine=self.engine, path=self.path, **fields)
        except Exception as exc:  # noqa: BLE001
            self.failed("logging", exc)

    def _moved(self, t: Ended) -> list[tuple[Any, int, int]]:
        """(request id, blocks, bytes) per request of a batch; the batch's own `nbytes` shared out by blocks.
        When completion named the blocks that moved, each request counts those of its own."""
        moved = t.reported_moved
        if moved is None:  # all of the batch's blocks moved
            counts = t.requests.items()
        else:
            kept = set(moved.distinct)
            counts = [(rid, len(kept.intersection(ids))) for rid, ids in t.request_blocks.items()]
        if t.nbytes is None:
            size = self.block_bytes
            return [(rid, c, c * size) for rid, c in counts]
        total = sum(c for _, c in counts) or 1
        return [(rid, c, t.nbytes * c // total) for rid, c in counts]

    def _hooks(self, t: Ended, moved: list[tuple[Any, int, int]]) -> None:
        """One TransferRecord per request (per transfer when it is not a batch)."""
        duration, wait, hold = _timings(t)
        for request_id, count, size in moved:
            record = TransferRecord(self.engine, self.path, t.outcome, duration, wait, hold, count, size,
                                    t.error, tuple(t.bad_block_ids), request_id, t.key)
            for hook in self.hooks:
                try:
                    hook(record)
                except Exception as exc:  # noqa: BLE001
                    self.failed("hook", exc)


_ZEROS = (0.0, 0.0, 0.0)
_THIRD = operator.itemgetter(2)


def _timings(t: Ended) -> tuple[float, float, float]:
    """(duration, lock wait, lock hold) in seconds; zeros for a transfer refused before it waited."""
    acquired = t.t_acquired
    if not acquired:
        return _ZEROS
    begin = t.t_begin
    end = t.t_end
    return end - begin, acquired - begin, end - acquired if end > acquired else 0.0


def _describe(error: BaseException | None) -> str | None:
    """`repr(error)`, or a fallback naming its type when the exception's own __repr__ raises."""
    if error is None:
        return None
    try:
        return repr(error)
    except Exception:  # noqa: BLE001 - an exception whose repr raises must still be reported
        return f"<{type(error).__qualname__} (repr failed)>"

