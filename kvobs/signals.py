"""Early layer0 signals: buffered until their transfer task registers, recovered exactly once, bounded.

Why: on a prefill node the model runner's "layer 0 is ready" signal for a batch slot can arrive before the
cache messager has registered the transfer task for that slot (DESIGN.md section 1, incident 2). Dropping it
hangs the request on the decode node; asserting kills the send thread. `EarlySignalBuffer` is the single
authority over which slots are registered and which signals wait.

Decisions. check-registered-or-buffer, register-and-recover, finish-and-drop, expire and overflow are each
taken atomically under the buffer's own lock.

Lock order: caller's locks -> buffer lock, never the reverse. While holding its lock the buffer calls only
the injected `clock` (which must not block or call back); metrics, logs, span events and `on_recovered` run
after the lock is released, so a caller may hold its own lock around any call and `on_recovered` may call
back into the buffer. The scrape-time gauges take the buffer lock from the scrape thread, which holds no
prometheus_client lock while it reads them.

Policies.
- A layer0 signal claiming more tokens than its task needs cannot belong to it: `dropped_invalid`, whether it
  was pending at `register()` or arrives for a live slot. The log carries slot and both token counts.
- Repeated early signals for one slot update its single pending entry: the larger cumulative token count
  wins whatever the arrival order; the age counts from the first. `buffered` counts entries, not repeats, so
  buffered = recovered + dropped (pending) + dropped_finished + expired + overflow + pending.
- A late layer0 signal for a finished slot looks exactly like an early one for the slot's next task (signals
  carry no request id), so it is buffered like one. It cannot stay: the TTL, `max_pending`, `finish()` and
  `register()`'s token check all remove it.
- `register()` of a live slot raises ValueError (a double registration is a bug upstream, and replacing
  silently would orphan the first task's send). `finish()` of an unknown slot only drops its pending signal.
- Layers other than 0 only advance a live slot's `progress()`; for an unregistered slot they are ignored.

Step-aligned mode (tensor parallel). Each TP rank runs its own buffer, and the ranks' send barriers deadlock
unless every rank releases the same batch at the same step. With `step_aligned=True`, `signal()`,
`signal_batch()`, `register()` and `finish()` only validate and record (they return None / []), and
`end_step()` decides, in a canonical order that ignores arrival order across threads: expire by step age; then
slot by slot (ascending) that slot's registrations and finishes in arrival order; then slot by slot the step's
signals (repeats merged: largest token count). It returns the step's batch: recovered signals, then ready ones,
each group by slot. The TTL counts steps (`ttl_steps`), not seconds, and overflow evicts in canonical order, so
no rank-local clock or thread timing enters a decision. Guarantee: ranks that record the same events before the
same `end_step()`, and for each slot its registrations and finishes in the same order, release identical
batches (slot, layer, tokens), however signals and registrations interleave. The caller must deliver a step's
registrations before that step's `end_step()` on every rank (e.g. register when the scheduler, which TP ranks
run in lockstep, schedules the request). `buffered_s` stays this rank's own measurement, counted from the
boundary that buffered the signal. A step in which more than `max_pending` distinct slots signal keeps the
`max_pending` lowest-numbered ones on every rank; the excess is `overflow` (that count alone may differ by rank).

Telemetry: `ready`/`buffered` are only counted (the hot path); recoveries and drops are also span events on the
current span when it records, and logs at debug (recovered) or warning (drops) when `log_level` allows, checked
here so an unconfigured structlog prints no line per request. A telemetry failure is counted, never raised.
"""

from __future__ import annotations

import heapq
import logging
import math
import operator
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from kvobs import semconv as sc
from kvobs.telemetry.logs import level_number
from kvobs.telemetry.metrics import EngineMetrics, bind_scrape_time

_READY, _BUFFERED, _RECOVERED = sc.SIGNAL_READY, sc.SIGNAL_BUFFERED, sc.SIGNAL_RECOVERED
_QUIET = frozenset((_READY, _BUFFERED))  # hot-path outcomes: counted, not logged
_DROPS = (sc.SIGNAL_DROPPED_INVALID, sc.SIGNAL_DROPPED_FINISHED, sc.SIGNAL_EXPIRED, sc.SIGNAL_OVERFLOW)

# (outcome, slot, tokens, need_tokens or None, buffered_s): decided under the lock, reported after it.
_Event = tuple[str, int, int, int | None, float]


@dataclass(frozen=True, slots=True)
class ReadySignal:
    """A layer0 signal whose send may start now. `buffered_s` is 0.0 when it never waited."""

    slot: int
    layer: int
    tokens: int
    buffered_s: float


def _ready_factory() -> Callable[[int, int, int, float], ReadySignal]:
    """ReadySignal(...) without the frozen __init__'s four object.__setattr__ calls (~0.7 us -> ~0.35 us)."""
    new = object.__new__
    set_slot, set_layer, set_tokens, set_waited = (
        getattr(ReadySignal, f).__set__ for f in ("slot", "layer", "tokens", "buffered_s"))

    def ready(slot: int, layer: int, tokens: int, buffered_s: float) -> ReadySignal:
        sig = new(ReadySignal)
        set_slot(sig, slot)
        set_layer(sig, layer)
        set_tokens(sig, tokens)
        set_waited(sig, buffered_s)
        return sig

    return ready


_ready = _ready_factory()


class _Pending:
    """One waiting early signal: `since` in decision time (seconds or steps), `wall` for ages."""

    __slots__ = ("tokens", "since", "wall")

    def __init__(self, tokens: int, since: float, wall: float) -> None:
        self.tokens, self.since, self.wall = tokens, since, wall


class _Task:
    """A registered slot: what it needs and how far the model runner has got, as (tokens, layer)."""

    __slots__ = ("need", "progress")

    def __init__(self, need: int) -> None:
        self.need, self.progress = need, (-1, -1)


def _as_int(value: Any, name: str, minimum: int = 0) -> int:
    """A Python int >= `minimum` from an int, numpy integer or one-element integer tensor; else a clear error."""
    if type(value) is int:
        result = value
    elif isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    else:
        try:
            result = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}") from None
    if result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    return result


def _ints(values: Any, name: str) -> list[int]:
    """Sequences, numpy arrays and tensors as a list of Python ints (one `.tolist()`, no per-item device sync)."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [_as_int(v, name) for v in values]


class EarlySignalBuffer:
    """Registered slots and the early layer0 signals waiting for them; see the module docstring.

    One buffer per EngineMetrics: the pending-count and oldest-age gauges read the buffer built last.
    """

    def __init__(
        self,
        *,
        metrics: EngineMetrics | None = None,
        logger: Any | None = None,
        ttl_s: float = 60.0,
        max_pending: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        on_recovered: Callable[[ReadySignal], None] | None = None,
        step_aligned: bool = False,
        ttl_steps: int = 1000,
        log_level: str | int = "info",
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        if _as_int(max_pending, "max_pending") < 1:
            raise ValueError("max_pending must be >= 1")
        if _as_int(ttl_steps, "ttl_steps") < 1:
            raise ValueError("ttl_steps must be >= 1")
        if step_aligned and on_recovered is not None:
            raise ValueError("step_aligned mode releases signals only through end_step(); drop on_recovered")
        self._metrics = metrics
        self._logger = logger
        # checked here, as the observer does, so an unconfigured structlog never prints a debug line per request
        level = level_number(log_level)
        self._log_methods = {_RECOVERED: "debug"} if level <= logging.DEBUG else {}
        if level <= logging.WARNING:
            self._log_methods.update(dict.fromkeys(_DROPS, "warning"))
        self._clock = clock
        self._on_recovered = on_recovered
        self._step_aligned = step_aligned
        self._ttl: float = ttl_steps if step_aligned else ttl_s
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._live: dict[int, _Task] = {}
        self._pending: OrderedDict[int, _Pending] = OrderedDict()  # oldest first: entries are never moved
        self._oldest_since = math.inf  # a lower bound of the oldest `since`: one compare decides a lazy sweep
        self._step = 0
        self._staged_ctl: dict[int, list[int | None]] = {}  # step mode: slot -> need_tokens, or None for finish
        self._staged_sig: dict[int, list[Any]] = {}  # step mode: slot -> [layer0 tokens or -1, (tokens, layer)]
        self._staged_heap: list[int] = []  # step mode: negated staged slots, to find the highest in O(1)
        if metrics is not None:
            def on_error() -> None:
                metrics.count_telemetry_error("scrape")

            try:
                bind_scrape_time(metrics.pending, lambda: len(self._pending), on_error)
                bind_scrape_time(metrics.oldest_age, self.oldest_pending_age, on_error)
            except Exception:  # noqa: BLE001 - telemetry must not break the engine
                metrics.count_telemetry_error("metrics")

    # -- public API ---------------------------------------------------------------------------------------

    def signal(self, slot: int, layer: int, tokens: int) -> ReadySignal | None:
        """Layer `layer` of `slot` holds `tokens` prompt tokens (cumulative). A ReadySignal if its send starts now."""
        if not (type(slot) is int and slot >= 0):
            slot = _as_int(slot, "slot")
        if not (type(layer) is int and layer >= 0):
            layer = _as_int(layer, "layer")
        if not (type(tokens) is int and tokens >= 0):
            tokens = _as_int(tokens, "tokens")
        out: list[_Event] = []
        with self._lock:
            if self._step_aligned:
                self._stage_signal(slot, layer, tokens, out)
                ready = None
            else:
                now = self._clock()
                if now - self._oldest_since > self._ttl:
                    self._expire_locked(now, now, out)
                ready = self._signal_locked(slot, layer, tokens, now, now, out)
        if out:
            self._report(out)
        return ready

    def signal_batch(self, layer: int, slots: Sequence[int] | Any, tokens: Sequence[int] | Any,
                     count: int | None = None) -> list[ReadySignal]:
        """One model-runner step for `layer`: the first `count` slots (all when None); count -1 or 0 is empty.

        Every value is validated before the lock is taken, so a bad batch changes nothing.
        """
        if count is not None:
            count = _as_int(count, "count", minimum=-1)
            if count <= 0:
                return []
        layer = _as_int(layer, "layer")
        slot_list, token_list = _ints(slots, "slot"), _ints(tokens, "tokens")
        if len(slot_list) != len(token_list):
            raise ValueError(f"{len(slot_list)} slots but {len(token_list)} token counts")
        if count is not None:
            if count > len(slot_list):
                raise ValueError(f"count {count} exceeds the {len(slot_list)} slots given")
            slot_list, token_list = slot_list[:count], token_list[:count]
        out: list[_Event] = []
        ready: list[ReadySignal] = []
        with self._lock:
            if self._step_aligned:
                for slot, tok in zip(slot_list, token_list):
                    self._stage_signal(slot, layer, tok, out)
            else:
                now = self._clock()
                if now - self._oldest_since > self._ttl:
                    self._expire_locked(now, now, out)
                for slot, tok in zip(slot_list, token_list):
                    sig = self._signal_locked(slot, layer, tok, now, now, out)
                    if sig is not None:
                        ready.append(sig)
        if out:
            self._report(out)
        return ready

    def register(self, slot: int, need_tokens: int) -> ReadySignal | None:
        """Register the transfer task for `slot`; recover its pending signal exactly once.

        The recovered signal is returned, or handed to `on_recovered` (then None is returned). An exception
        from `on_recovered` propagates: the registration already stands, and a lost send must not be silent.
        """
        if not (type(slot) is int and slot >= 0):
            slot = _as_int(slot, "slot")
        if not (type(need_tokens) is int and need_tokens >= 0):
            need_tokens = _as_int(need_tokens, "need_tokens")
        out: list[_Event] = []
        recovered = None
        with self._lock:
            if self._step_aligned:
                ops = self._staged_ctl.get(slot)
                duplicate = ops[-1] is not None if ops else slot in self._live
                if not duplicate:
                    self._staged_ctl.setdefault(slot, []).append(need_tokens)
            else:
                now = self._clock()
                if now - self._oldest_since > self._ttl:
                    self._expire_locked(now, now, out)
                duplicate = slot in self._live
                if not duplicate:
                    recovered = self._register_locked(slot, need_tokens, now, out)
        if out:
            self._report(out)
        if duplicate:
            raise ValueError(f"slot {slot} is already registered; finish() it before registering it again")
        if recovered is not None and self._on_recovered is not None:
            self._on_recovered(recovered)
            return None
        return recovered

    def finish(self, slot: int) -> None:
        """The task of `slot` finished or failed: unregister it and drop any signal still pending for it."""
        if not (type(slot) is int and slot >= 0):
            slot = _as_int(slot, "slot")
        out: list[_Event] = []
        with self._lock:
            if self._step_aligned:
                self._staged_ctl.setdefault(slot, []).append(None)
            else:
                now = self._clock()
                if now - self._oldest_since > self._ttl:
                    self._expire_locked(now, now, out)
                self._finish_locked(slot, now, out)
        if out:
            self._report(out)

    def expire(self) -> int:
        """Drop pending signals older than the TTL (seconds, or steps in step-aligned mode); how many."""
        out: list[_Event] = []
        with self._lock:
            wall = self._clock()
            self._expire_locked(self._step if self._step_aligned else wall, wall, out)
        if out:
            self._report(out)
        return len(out)

    def end_step(self) -> list[ReadySignal]:
        """Step-aligned mode: decide this step's recorded events canonically; the batch every rank releases."""
        if not self._step_aligned:
            raise RuntimeError("end_step() needs EarlySignalBuffer(step_aligned=True)")
        out: list[_Event] = []
        batch: list[ReadySignal] = []
        with self._lock:
            self._step += 1
            now, wall = self._step, self._clock()
            ctl, sig = self._staged_ctl, self._staged_sig
            self._staged_ctl, self._staged_sig, self._staged_heap = {}, {}, []
            self._expire_locked(now, wall, out)
            for slot in sorted(ctl):
                for need in ctl[slot]:
                    if need is None:
                        self._finish_locked(slot, wall, out)
                    else:
                        recovered = self._register_locked(slot, need, wall, out)
                        if recovered is not None:
                            batch.append(recovered)
            for slot in sorted(sig):
                layer0_tokens, (tokens, layer) = sig[slot]
                if layer > 0:
                    self._signal_locked(slot, layer, tokens, now, wall, out)
                if layer0_tokens >= 0:
                    ready = self._signal_locked(slot, 0, layer0_tokens, now, wall, out)
                    if ready is not None:
                        batch.append(ready)
        if out:
            self._report(out)
        return batch

    @property
    def pending_count(self) -> int:
        """Signals waiting for their task (in step-aligned mode: as of the last end_step)."""
        return len(self._pending)

    def oldest_pending_age(self) -> float:
        """Seconds the oldest pending signal has waited; 0.0 when none. Read at scrape time."""
        with self._lock:
            wall = next(iter(self._pending.values())).wall if self._pending else None
        return 0.0 if wall is None else max(0.0, self._clock() - wall)

    def registered_slots(self) -> frozenset[int]:
        """Slots with a live task (in step-aligned mode: as of the last end_step)."""
        with self._lock:
            return frozenset(self._live)

    def progress(self, slot: int) -> tuple[int, int] | None:
        """(layer, tokens) of the furthest signal seen for live `slot`; None if unregistered or no signal yet."""
        with self._lock:
            task = self._live.get(slot)
            if task is None or task.progress[0] < 0:
                return None
            tokens, layer = task.progress
            return layer, tokens

    # -- decisions, under self._lock --------------------------------------------------------------------------

    def _signal_locked(self, slot: int, layer: int, tokens: int, now: float, wall: float,
                       out: list[_Event]) -> ReadySignal | None:
        task = self._live.get(slot)
        if task is not None:
            if layer == 0 and tokens > task.need:
                out.append((sc.SIGNAL_DROPPED_INVALID, slot, tokens, task.need, 0.0))
                return None
            if (tokens, layer) > task.progress:
                task.progress = (tokens, layer)
            if layer:
                return None
            out.append((_READY, slot, tokens, task.need, 0.0))
            return _ready(slot, 0, tokens, 0.0)
        if layer:
            return None
        pending = self._pending
        entry = pending.get(slot)
        if entry is not None:
            if tokens > entry.tokens:
                entry.tokens = tokens
            return None
        if len(pending) >= self._max_pending:
            old_slot, old = pending.popitem(last=False)
            out.append((sc.SIGNAL_OVERFLOW, old_slot, old.tokens, None, wall - old.wall))
        if not pending:
            self._oldest_since = now
        pending[slot] = _Pending(tokens, now, wall)
        out.append((_BUFFERED, slot, tokens, None, 0.0))
        return None

    def _register_locked(self, slot: int, need: int, wall: float, out: list[_Event]) -> ReadySignal | None:
        task = self._live[slot] = _Task(need)
        entry = self._pending.pop(slot, None)
        if entry is None:
            return None
        waited = wall - entry.wall
        if entry.tokens > need:
            out.append((sc.SIGNAL_DROPPED_INVALID, slot, entry.tokens, need, waited))
            return None
        task.progress = (entry.tokens, 0)
        out.append((_RECOVERED, slot, entry.tokens, need, waited))
        return _ready(slot, 0, entry.tokens, waited)

    def _finish_locked(self, slot: int, wall: float, out: list[_Event]) -> None:
        task = self._live.pop(slot, None)
        entry = self._pending.pop(slot, None)
        if entry is not None:
            need = None if task is None else task.need
            out.append((sc.SIGNAL_DROPPED_FINISHED, slot, entry.tokens, need, wall - entry.wall))

    def _expire_locked(self, now: float, wall: float, out: list[_Event]) -> None:
        pending = self._pending
        while pending:
            slot = next(iter(pending))
            entry = pending[slot]
            if now - entry.since <= self._ttl:
                self._oldest_since = entry.since
                return
            del pending[slot]
            out.append((sc.SIGNAL_EXPIRED, slot, entry.tokens, None, wall - entry.wall))
        self._oldest_since = math.inf

    def _stage_signal(self, slot: int, layer: int, tokens: int, out: list[_Event]) -> None:
        """Merge into the step's record; beyond max_pending slots keep the lowest-numbered ones (order-free)."""
        staged = self._staged_sig.get(slot)
        if staged is None:
            if len(self._staged_sig) >= self._max_pending:
                highest = -self._staged_heap[0]
                if slot > highest:
                    out.append((sc.SIGNAL_OVERFLOW, slot, tokens, None, 0.0))
                    return
                heapq.heappop(self._staged_heap)
                evicted = self._staged_sig.pop(highest)
                out.append((sc.SIGNAL_OVERFLOW, highest, max(evicted[0], evicted[1][0]), None, 0.0))
            heapq.heappush(self._staged_heap, -slot)
            staged = self._staged_sig[slot] = [-1, (-1, -1)]
        if layer == 0:
            if tokens > staged[0]:
                staged[0] = tokens
        elif (tokens, layer) > staged[1]:
            staged[1] = (tokens, layer)

    # -- telemetry, after the lock is released; it never raises and never changes a decision -----------------

    def _report(self, events: list[_Event]) -> None:
        metrics = self._metrics
        for event in events:
            outcome = event[0]
            if metrics is not None:
                try:
                    metrics.signals[outcome].inc()
                    if outcome == _RECOVERED:
                        metrics.signal_buffered.observe(event[4])
                except Exception:  # noqa: BLE001
                    metrics.count_telemetry_error("metrics")
            if outcome not in _QUIET:
                self._describe(event)

    def _describe(self, event: _Event) -> None:
        """A span event on the current span (when recording) and a structured log, with slot and token counts."""
        try:
            span = trace.get_current_span()
            recording = span.is_recording()
        except Exception:  # noqa: BLE001
            recording = False
            if self._metrics is not None:
                self._metrics.count_telemetry_error("tracing")
        method = self._log_methods.get(event[0]) if self._logger is not None else None
        if not recording and method is None:
            return  # nobody records it: build nothing
        outcome, slot, tokens, need, _ = event
        attrs: dict[str, Any] = {sc.ATTR_SLOT: slot, sc.ATTR_TOKENS: tokens, sc.ATTR_OUTCOME: outcome}
        if need is not None:
            attrs[sc.ATTR_NEED_TOKENS] = need
        name = sc.EVENT_SIGNAL_RECOVERED if outcome == _RECOVERED else sc.EVENT_SIGNAL_DROPPED
        if recording:
            try:
                span.add_event(name, attrs)
            except Exception:  # noqa: BLE001
                if self._metrics is not None:
                    self._metrics.count_telemetry_error("tracing")
        if method is not None:
            try:
                getattr(self._logger, method)(name, **attrs)
            except Exception:  # noqa: BLE001
                if self._metrics is not None:
                    self._metrics.count_telemetry_error("logging")
