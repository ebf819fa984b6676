"""What a signal buffer tells the outside world about its decisions: metrics, span events and logs.

Why outcomes are tallied in plain ints: a metric update costs about as much as the whole decision it would
count. The buffer counts each outcome and notes each recovered signal's wait under the lock it already holds;
`Tally.flush` adds them to the metric children in one batch. A flush runs whenever the pending-signals gauge
is read (kvobs's collector reads its gauges before it snapshots the counters, so a scrape shows every
decision taken before it), on every gauge refresh in multiprocess mode, once FLUSH_AT waits are noted, and
when the buffer is garbage-collected or the process exits. A forked child starts from empty tallies: what the
parent counted, the parent flushes.

Drops are span events on the caller's current span (when it records) and warnings logged at most once per
outcome per LOG_INTERVAL_S, with the number of lines left out; recoveries are logged at debug. A telemetry
failure never reaches the engine and never changes a decision: it is counted in kvobs_telemetry_errors_total
and logged once per kind per interval, by the metrics layer's TelemetryFailures.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Sized
from typing import Any

from opentelemetry import trace

from kvobs import semconv as sc
from kvobs.signals._records import Decision
from kvobs.telemetry._failures import STAGE_LOGGING, STAGE_METRICS, STAGE_TRACING, Failed, TelemetryFailures
from kvobs.telemetry._logs import level_number
from kvobs.telemetry._metrics.engine_metrics import EngineMetrics
from kvobs.telemetry._metrics.multiprocess import histogram_adder
from kvobs.telemetry._ratelimit import RateLimitedLog

FLUSH_AT = 512  # recovered waits noted before a flush is forced: bounds the memory between two scrapes
LOG_INTERVAL_S = 10.0
ATTR_WAITED_S = sc.ATTR_WAITED_S

READY, BUFFERED, RECOVERED, INVALID, FINISHED, EXPIRED, OVERFLOW, REFUSED = (
    sc.SIGNAL_OUTCOMES.index(o) for o in (sc.SIGNAL_READY, sc.SIGNAL_BUFFERED, sc.SIGNAL_RECOVERED,
                                          sc.SIGNAL_DROPPED_INVALID, sc.SIGNAL_DROPPED_FINISHED, sc.SIGNAL_EXPIRED,
                                          sc.SIGNAL_OVERFLOW, sc.SIGNAL_REFUSED))
DROPPED_PENDING = len(sc.SIGNAL_OUTCOMES)  # Tally.counts' last entry: pending signals dropped (see Tally)
_NONE_COUNTED = [0] * (DROPPED_PENDING + 1)
_DROPS = (sc.SIGNAL_DROPPED_INVALID, sc.SIGNAL_DROPPED_FINISHED, sc.SIGNAL_EXPIRED, sc.SIGNAL_OVERFLOW,
          sc.SIGNAL_REFUSED)


class Tally:
    """Outcome counts and recovered waits of one buffer, changed only under that buffer's lock until flushed.

    `counts` is indexed by the position of each outcome in sc.SIGNAL_OUTCOMES (READY, BUFFERED, ...), then
    DROPPED_PENDING. Two counts are derived, one step less each on the hot paths: a recovery is counted by
    noting its wait, and a buffered signal by the pending dict itself, as every signal buffered is still
    pending, recovered or dropped from it (`dropped()` counts those drops twice: by outcome and in
    DROPPED_PENDING)."""

    __slots__ = ("counts", "waits", "_lock", "_pending", "_pending_then", "_counters", "_add_waits", "_failed")

    def __init__(self, lock: threading.Lock, pending: Sized, metrics: EngineMetrics | None,
                 failed: Failed) -> None:
        self.counts: list[int] = list(_NONE_COUNTED)
        self.waits: list[float] = []
        self._lock = lock
        self._pending = pending
        self._pending_then = len(pending)  # at the last flush
        self._failed = failed
        self._counters = [metrics.signals[o] for o in sc.SIGNAL_OUTCOMES] if metrics is not None else None
        self._add_waits = histogram_adder(metrics.signal_buffered) if metrics is not None else None

    def dropped(self, outcome: int, n: int = 1) -> None:
        """`n` pending signals dropped with `outcome` (under the buffer's lock)."""
        counts = self.counts
        counts[outcome] += n
        counts[DROPPED_PENDING] += n

    def flush(self) -> None:
        with self._lock:
            self.flush_locked()

    def flush_locked(self) -> None:
        """Move everything counted into the metric children; a child that raises loses its delta, counted."""
        counts = self.counts
        waits = self.waits
        pending = len(self._pending)
        counts[RECOVERED] += len(waits)
        counts[BUFFERED] = pending - self._pending_then + counts[RECOVERED] + counts[DROPPED_PENDING]
        self._pending_then = pending
        if self._counters is not None:
            for counter, n in zip(self._counters, counts):  # DROPPED_PENDING, the last count, has no counter
                if n:
                    try:
                        counter.inc(n)
                    except Exception as exc:  # noqa: BLE001 - telemetry never breaks the engine
                        self._failed(STAGE_METRICS, exc)
            if waits:
                try:
                    self._add_waits(waits)
                except Exception as exc:  # noqa: BLE001
                    self._failed(STAGE_METRICS, exc)
        self._clear()

    def renew(self, lock: threading.Lock) -> None:
        """In a forked child: the buffer's new lock; the parent's unflushed counts are the parent's to flush."""
        self._lock = lock
        self._pending_then = len(self._pending)
        self._clear()

    def _clear(self) -> None:
        self.counts[:] = _NONE_COUNTED
        self.waits.clear()


class SignalReporter:
    """Span events and logs of one buffer's decisions; its `tally` holds the counts (`pending`: the buffer's
    pending signals), `failed(stage, exc)` takes the telemetry failures."""

    def __init__(self, lock: threading.Lock, pending: Sized, metrics: EngineMetrics | None, logger: Any | None,
                 log_level: str | int, clock: Callable[[], float]) -> None:
        level = level_number(log_level)
        # checked here, as the observer does, so an unconfigured structlog never prints a line per request
        self._levels = {sc.SIGNAL_RECOVERED: "debug"} if level <= logging.DEBUG else {}
        if level <= logging.WARNING:
            self._levels.update(dict.fromkeys(_DROPS, "warning"))
        self._logger = logger
        # counted (and logged once per kind) by the metrics layer; without metrics, logged all the same
        failed: Failed = (metrics.count_telemetry_error if metrics is not None
                          else TelemetryFailures("", None, logger))
        self.failed = failed
        self._log = None if logger is None else RateLimitedLog(
            logger, LOG_INTERVAL_S, clock=clock, on_error=functools.partial(failed, STAGE_LOGGING))
        self.tally = Tally(lock, pending, metrics, failed)

    def describes(self, outcome: str) -> bool:
        """Whether a decision with `outcome` is ever described (span events describe drops only)."""
        return outcome in _DROPS or (self._logger is not None and outcome in self._levels)

    def describe(self, decisions: Iterable[Decision]) -> None:
        """For a drop, a span event on the current span (when it records); for every decision, its log line
        when the level allows (drops rate-limited per outcome). Never raises."""
        try:
            span = trace.get_current_span()
            recording = span.is_recording()
        except Exception as exc:  # noqa: BLE001
            recording = False
            self.failed(STAGE_TRACING, exc)
        levels = self._levels if self._logger is not None else {}
        for d in decisions:
            level = levels.get(d.outcome)
            as_event = recording and d.outcome in _DROPS
            if not as_event and level is None:
                continue  # nobody records it: build nothing
            attrs: dict[str, Any] = {sc.ATTR_SLOT: d.slot, sc.ATTR_OUTCOME: d.outcome, ATTR_WAITED_S: d.waited_s}
            if d.tokens is not None:
                attrs[sc.ATTR_TOKENS] = d.tokens
            if d.need_tokens is not None:
                attrs[sc.ATTR_NEED_TOKENS] = d.need_tokens
            name = sc.EVENT_SIGNAL_RECOVERED if d.outcome == sc.SIGNAL_RECOVERED else sc.EVENT_SIGNAL_DROPPED
            if as_event:
                try:
                    span.add_event(name, attrs)
                except Exception as exc:  # noqa: BLE001
                    self.failed(STAGE_TRACING, exc)
            if level == "debug":
                try:
                    self._logger.debug(name, **attrs)
                except Exception as exc:  # noqa: BLE001
                    self.failed(STAGE_LOGGING, exc)
            elif level is not None:
                self._log.log(d.outcome, level, name, **attrs)  # type: ignore[union-attr]
