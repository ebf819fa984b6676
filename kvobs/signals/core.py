"""The state both signal buffers share, and every decision on it.

Why one core: `EarlySignalBuffer` decides at each call, `StepAlignedSignalBuffer` at each step boundary in a
canonical order, but a signal, a registration, a finish, an expiry and an overflow must mean the same in both.
Each `_*_locked` method is one atomic decision taken with `self._lock` held: it counts its outcome in the tally
and appends what must be described to `out` (span events and logs run after the lock is released).

Lock order: caller's locks -> buffer lock, never the reverse. Under its lock a buffer calls only the injected
`clock` (which must not block or call back) and, when it flushes its tally, the metric children's `inc`.

Policies:
- A layer0 signal claiming more tokens than its task needs cannot belong to it: `dropped_invalid`, whether it
  was pending at registration or arrives for a live slot.
- Repeated early signals for one slot update its single pending entry: the largest cumulative token count
  wins whatever the arrival order; the age counts from the first. `buffered` counts entries, not repeats, so
  buffered = recovered + dropped_invalid (of pending ones) + dropped_finished + expired + overflow + pending.
- A late layer0 signal for a finished slot looks exactly like an early one for the slot's next task (signals
  carry no request id), so it is buffered like one; the TTL, `max_pending`, `finish()` and the registration's
  token check all remove it.
- Layers other than 0 only advance a live slot's `progress()`; for an unregistered slot they are ignored.
- Memory is bounded: at most `max_pending` signals wait (a new one evicts the oldest: `overflow`) and at most
  `max_slots` tasks are registered (one more is `refused` and changes nothing).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvobs import semconv as sc
from kvobs.forks import renewed_after_fork
from kvobs.signals.inputs import as_int
from kvobs.signals.records import (
    Decision,
    Pending,
    Progress,
    ReadySignal,
    decision,
)
from kvobs.signals.reporting import FLUSH_AT, SignalReporter
from kvobs.telemetry.engine_metrics import EngineMetrics
from kvobs.telemetry.failures import STAGE_METRICS

DEFAULT_MAX_SLOTS = 16384

_READY, _BUFFERED, _RECOVERED = sc.SIGNAL_READY, sc.SIGNAL_BUFFERED, sc.SIGNAL_RECOVERED
_INVALID, _FINISHED, _EXPIRED = sc.SIGNAL_DROPPED_INVALID, sc.SIGNAL_DROPPED_FINISHED, sc.SIGNAL_EXPIRED
_OVERFLOW, _REFUSED = sc.SIGNAL_OVERFLOW, sc.SIGNAL_REFUSED
_new = tuple.__new__  # ReadySignal(...) without the generated __new__'s argument handling: the hot path


class _Task:
    """A registered slot: what its task needs, and the furthest (tokens, layer) signalled for it."""

    __slots__ = ("need", "tokens", "layer")

    def __init__(self, need: int, tokens: int, layer: int) -> None:
        self.need, self.tokens, self.layer = need, tokens, layer


class SignalBufferCore:
    """Registered slots, their progress and the early layer0 signals waiting for them; see the module docstring.

    A subclass supplies `_now_locked(out)`: the (decision time, wall time) of a decision that touches a
    pending signal, after expiring what is due by then. One buffer per EngineMetrics: the pending-count and
    oldest-age gauges read the buffer built last.
    """

    def __init__(self, *, metrics: EngineMetrics | None, logger: Any | None, ttl: float, max_pending: int,
                 max_slots: int, clock: Callable[[], float], log_level: str | int) -> None:
        if as_int(max_pending, "max_pending") < 1:
            raise ValueError("max_pending must be >= 1")
        if as_int(max_slots, "max_slots") < 1:
            raise ValueError("max_slots must be >= 1")
        self._lock = threading.Lock()
        self._clock = clock
        self._ttl = ttl
        self._max_pending = max_pending
        self._max_slots = max_slots
        self._live: dict[int, _Task] = {}
        self._pending: OrderedDict[int, Pending] = OrderedDict()  # oldest first: entries are never moved
        self._expire_at = math.inf  # nothing pending expires before this: one compare decides a lazy sweep
        self._reporter = SignalReporter(self._lock, metrics, logger, log_level, clock)
        self._describe_recoveries = self._reporter.describes(sc.SIGNAL_RECOVERED)
        self._tally = self._reporter.tally
        self._counts, self._waits = self._tally.counts, self._tally.waits
        _renewed_after_fork.add(self)
        if metrics is not None:
            weakref.finalize(self, self._tally.flush)  # counts of a buffer the engine drops are kept
            try:  # the gauges hold this buffer weakly: dropped, it is collected and they read 0
                metrics.bind_pending_signals(self, SignalBufferCore._pending_at_scrape,
                                             SignalBufferCore.oldest_pending_age)
            except Exception as exc:  # noqa: BLE001 - telemetry must not break the engine
                self._reporter.failed(STAGE_METRICS, exc)

    def _now_locked(self, out: list[Decision]) -> tuple[float, float]:
        raise NotImplementedError

    def _after_fork_in_child(self) -> None:
        """A lock another thread held at the fork would stay held in the child forever: a new one."""
        self._lock = threading.Lock()
        self._tally.renew(self._lock)

    # -- reads ------------------------------------------------------------------------------------------------

    def _pending_at_scrape(self) -> int:
        """The pending count for the gauge; first the counts tallied since the last scrape go to the metrics."""
        self._tally.flush()
        return len(self._pending)

    @property
    def pending_count(self) -> int:
        """Signals waiting for their task."""
        return len(self._pending)

    def oldest_pending_age(self) -> float:
        """Seconds the oldest pending signal has waited; 0.0 when none. Read at scrape time."""
        with self._lock:
            wall = next(iter(self._pending.values())).wall if self._pending else None
        return 0.0 if wall is None else max(0.0, self._clock() - wall)

    def registered_slots(self) -> frozenset[int]:
        """Slots with a live task."""
        with self._lock:
            return frozenset(self._live)

    def progress(self, slot: int) -> Progress | None:
        """The furthest (tokens, layer) signalled for live `slot`; None if unregistered or no signal yet."""
        with self._lock:
            task = self._live.get(slot)
            if task is None or task.tokens < 0:
                return None
            return Progress(task.tokens, task.layer)

    # -- decisions, under self._lock ---------------------------------------------------------------------------

    def _signal_locked(self, slot: int, layer: int, tokens: int, out: list[Decision]) -> ReadySignal | None:
        task = self._live.get(slot)
        if task is not None:
            if layer:
                if tokens > task.tokens or (tokens == task.tokens and layer > task.layer):
                    task.tokens, task.layer = tokens, layer
                return None
            if tokens > task.need:
                self._counts[_INVALID] += 1
                out.append(decision(_INVALID, slot, tokens, task.need, 0.0))
                return None
            if tokens > task.tokens:
                task.tokens, task.layer = tokens, 0
            self._counts[_READY] += 1
            return _new(ReadySignal, (slot, 0, tokens, 0.0))
        if layer:
            return None
        pending = self._pending
        entry = pending.get(slot)
        if entry is not None:
            if tokens > entry.tokens:
                entry.tokens = tokens
            return None
        now, wall = self._now_locked(out)
        if len(pending) >= self._max_pending:
            evicted_slot, evicted = pending.popitem(last=False)
            self._counts[_OVERFLOW] += 1
            out.append(decision(_OVERFLOW, evicted_slot, evicted.tokens, None, wall - evicted.wall))
        if not pending:
            self._expire_at = now + self._ttl
        pending[slot] = Pending(tokens, now, wall)
        self._counts[_BUFFERED] += 1
        return None

    def _refuse_locked(self, slot: int, need: int, out: list[Decision]) -> None:
        """A registration while `max_slots` tasks are live: counted, described, nothing changed."""
        self._counts[_REFUSED] += 1
        out.append(decision(_REFUSED, slot, None, need, 0.0))

    def _register_locked(self, slot: int, need: int, out: list[Decision]) -> ReadySignal | None:
        """Register `slot` (not live, room checked) and recover its pending signal, if it can belong to it."""
        if slot not in self._pending:
            self._live[slot] = _Task(need, -1, -1)
            return None
        _, wall = self._now_locked(out)  # expires what is due first: an expired signal is never recovered
        entry = self._pending.pop(slot, None)
        if entry is None or entry.tokens > need:
            self._live[slot] = _Task(need, -1, -1)
            if entry is not None:
                self._counts[_INVALID] += 1
                out.append(decision(_INVALID, slot, entry.tokens, need, wall - entry.wall))
            return None
        tokens, waited = entry.tokens, wall - entry.wall
        self._live[slot] = _Task(need, tokens, 0)
        self._counts[_RECOVERED] += 1
        waits = self._waits
        waits.append(waited)
        if len(waits) >= FLUSH_AT:
            self._tally.flush_locked()
        if self._describe_recoveries:
            out.append(decision(_RECOVERED, slot, tokens, need, waited))
        return _new(ReadySignal, (slot, 0, tokens, waited))

    def _finish_locked(self, slot: int, out: list[Decision]) -> None:
        task = self._live.pop(slot, None)
        if slot in self._pending:
            _, wall = self._now_locked(out)
            entry = self._pending.pop(slot, None)
            if entry is not None:
                self._counts[_FINISHED] += 1
                out.append(decision(_FINISHED, slot, entry.tokens, None if task is None else task.need,
                                    wall - entry.wall))

    def _expire_locked(self, now: float, wall: float, out: list[Decision]) -> None:
        pending, ttl = self._pending, self._ttl
        while pending:
            slot = next(iter(pending))
            entry = pending[slot]
            if now <= entry.since + ttl:
                self._expire_at = entry.since + ttl
                return
            del pending[slot]
            self._counts[_EXPIRED] += 1
            out.append(decision(_EXPIRED, slot, entry.tokens, None, wall - entry.wall))
        self._expire_at = math.inf


_renewed_after_fork = renewed_after_fork(SignalBufferCore._after_fork_in_child)
