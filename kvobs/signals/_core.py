"""The state both signal buffers share, and every decision on it.

Why one core: `EarlySignalBuffer` decides at each call, `StepAlignedSignalBuffer` at each step boundary in a
canonical order, but a signal, a registration, a finish, an expiry and an overflow must mean the same in both.
So each is decided in one place here: a registration in `register()`, a finish in `finish()`, each one pass under
`self._lock` (entered as `with self._held:`), and a signal in `_signal_locked()`, which its callers run under the
lock: `signal()` for one signal, `signal_batch()` and `end_step()` once for all their signals, as a model-runner
step signals every slot of a layer at once. Each decides the common outcomes inline, counts them in the tally,
and calls a `_*_locked` helper for each rare one (a drop, an expiry due, a bound reached), which collects what
must be described; span events, logs and `on_recovered` run after the lock is released. `EarlySignalBuffer`
uses these as they are, on the engine's hot path, so they are written for speed (docs/benchmarks.md,
"Signal buffer"); `StepAlignedSignalBuffer.end_step()` applies the calls it recorded through them.

Lock order: caller's locks -> buffer lock, never the reverse. Under its lock a buffer calls only the injected
`clock` (which must not block or call back) and, when it flushes its tally, the metric children's `inc`.

Policies:
- A layer0 signal claiming more tokens than its task needs cannot belong to it: `dropped_invalid`, whether it
  was pending at registration or arrives for a live slot.
- Repeated early signals for one slot update its single pending entry: the largest cumulative token count
  wins whatever the arrival order; the age counts from the first. `buffered` counts entries, not repeats:
  buffered = recovered + dropped_invalid (of pending ones) + dropped_finished + expired + overflow + pending,
  which is how the tally derives it.
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
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from kvobs import semconv as sc
from kvobs._runtime.forks import renewed_after_fork
from kvobs.errors import SignalBufferFull
from kvobs.signals._inputs import as_int
from kvobs.signals._records import (
    KEPT_TOKENS,
    LAYER,
    NEED,
    SINCE,
    TOKENS,
    WALL,
    Decision,
    Progress,
    ReadySignal,
    decision,
    ready_signal,
)
from kvobs.signals._reporting import (
    EXPIRED,
    FINISHED,
    FLUSH_AT,
    INVALID,
    OVERFLOW,
    READY,
    REFUSED,
    SignalReporter,
)
from kvobs.telemetry._failures import STAGE_METRICS
from kvobs.telemetry._metrics.engine_metrics import EngineMetrics

DEFAULT_MAX_SLOTS = 16384
EXPIRY_DUE = -math.inf  # `_expire_at` while nothing is pending: the next signal buffered takes the general path
_REFUSE = "refuse"  # register() raises SignalBufferFull once its lock is released


def held(lock: threading.Lock) -> AbstractContextManager[bool]:
    """`with held(lock):` is `with lock:` for less (docs/benchmarks.md, "Signal buffer").

    `with` looks `__enter__` and `__exit__` up on the type, and for a lock each lookup builds a new bound method.
    This one-off class holds the lock's own bound methods, which `with` finds ready. The same C functions run,
    so an asynchronous exception leaves the lock exactly as it would leave `with lock:`.
    """
    return type("Held", (), {"__slots__": (), "__enter__": lock.__enter__, "__exit__": lock.__exit__})()


class SignalBufferCore:
    """Registered slots, their progress and the early layer0 signals waiting for them; see the module docstring.

    A subclass supplies `_now_locked(out)`: the (decision time, wall time) of a decision that touches a
    pending signal, after expiring what is due by then. One buffer per EngineMetrics: the pending-count and
    oldest-age gauges read the buffer built last.

    A recovery notes its wait without checking how many are noted: each one makes a slot live, and only
    `finish()` ends a live slot, so `finish()` flushing past FLUSH_AT bounds them to FLUSH_AT + `max_slots`.

    `decision_clock` reads the decision time (in the TTL's unit) on the decisions' fast paths: `EarlySignalBuffer`
    passes its clock, whose reading is the wall time too; the step-aligned buffer passes its step.
    `on_recovered` receives the recovered signals (a ReadySignal) once the lock is released, instead of the
    caller of `register()`; `_describe` receives what is to be described, once the lock is released.
    """

    def __init__(self, *, metrics: EngineMetrics | None, logger: Any | None, ttl: float, max_pending: int,
                 max_slots: int, clock: Callable[[], float], decision_clock: Callable[[], float],
                 on_recovered: Callable[[ReadySignal], None] | None, log_level: str | int) -> None:
        if as_int(max_pending, "max_pending") < 1:
            raise ValueError("max_pending must be >= 1")
        if as_int(max_slots, "max_slots") < 1:
            raise ValueError("max_slots must be >= 1")
        self._lock = threading.Lock()
        self._held = held(self._lock)
        self._clock = clock
        self._decision_clock = decision_clock
        self._ttl = ttl
        self._max_pending = max_pending
        self._max_slots = max_slots
        self._live: dict[int, list[int]] = {}  # slot -> task: see kvobs.signals._records
        # slot -> (tokens, since, wall), oldest first: entries are never moved. A plain dict, cheaper per insert
        # and delete than an OrderedDict; see _evict_oldest_locked for its front.
        self._pending: dict[int, tuple[int, float, float]] = {}
        self._evicted = 0  # entries evicted since the pending dict was last compacted
        # nothing pending expires before this: one compare decides a lazy sweep. Whenever nothing is pending it
        # is at most (next signal's time + ttl), so a signal buffered without a sweep is never late.
        self._expire_at = EXPIRY_DUE
        self._reporter = SignalReporter(self._lock, self._pending, metrics, logger, log_level, clock)
        self._describe: Callable[[list[Decision]], None] = self._reporter.describe
        self._describe_recoveries = self._reporter.describes(sc.SIGNAL_RECOVERED)
        self._on_recovered = on_recovered
        # Counts below which a decision takes its fast path, which reads the decision time as the wall time too
        # and hands nothing over: none for a buffer whose times differ (the step-aligned one), and none for a
        # recovery when one must be described or handed to on_recovered.
        timed_by_clock = decision_clock is clock
        self._buffer_room = max_pending if timed_by_clock else 0
        self._quiet_room = (max_slots if timed_by_clock and on_recovered is None and not self._describe_recoveries
                            else 0)
        self._tally = self._reporter.tally
        self._counts = self._tally.counts
        self._waits = self._tally.waits
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
        """A lock another thread held at the fork would stay held in the child forever: a new one. The early
        signals pending at the fork arrived in the parent, which recovers, drops and reports them; the child
        starts without them (its gauges would show them a second time, and their age would grow there until
        the stale-signal alert fired)."""
        self._lock = threading.Lock()
        self._held = held(self._lock)
        self._pending.clear()
        self._evicted = 0
        self._expire_at = EXPIRY_DUE
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
        with self._held:
            wall = next(iter(self._pending.values()))[WALL] if self._pending else None
        return 0.0 if wall is None else max(0.0, self._clock() - wall)

    def registered_slots(self) -> frozenset[int]:
        """Slots with a live task."""
        with self._held:
            return frozenset(self._live)

    def progress(self, slot: int) -> Progress | None:
        """The furthest (tokens, layer) signalled for live `slot`; None if unregistered or no signal yet."""
        with self._held:
            task = self._live.get(slot)
            if task is None or task[TOKENS] < 0:
                return None
            return Progress(task[TOKENS], task[LAYER])

    # -- decisions ----------------------------------------------------------------------------------------------

    def signal(self, slot: int, layer: int, tokens: int) -> bool:
        """Layer `layer` of `slot` holds `tokens` prompt tokens (cumulative). True if its send starts now
        (a layer0 signal for a registered task), with these tokens."""
        if not (type(slot) is int and type(layer) is int and type(tokens) is int
                and slot >= 0 and layer >= 0 and tokens >= 0):
            slot = as_int(slot, "slot")
            layer = as_int(layer, "layer")
            tokens = as_int(tokens, "tokens")
        with self._held:
            decided = self._signal_locked(slot, layer, tokens)
        if decided is True:
            return True
        if decided:
            self._describe(decided)
        return False

    def _signal_locked(self, slot: int, layer: int, tokens: int) -> bool | list[Decision]:
        """signal()'s decision, for a caller that holds the lock (a batch holds it once for all its signals):
        whether the send starts now, or (it does not) the decisions to describe once the lock is released."""
        live = self._live
        if slot in live:  # `in` then `[]`: cheaper than get() where the slot is not live
            task = live[slot]
            if layer:
                if tokens > task[TOKENS] or (tokens == task[TOKENS] and layer > task[LAYER]):
                    task[TOKENS] = tokens
                    task[LAYER] = layer
                return False
            if tokens <= task[NEED]:
                if tokens > task[TOKENS]:
                    task[TOKENS] = tokens
                    task[LAYER] = 0
                self._counts[READY] += 1
                return True
            self._counts[INVALID] += 1  # more tokens than the task needs: not its signal
            return [decision(sc.SIGNAL_DROPPED_INVALID, slot, tokens, task[NEED], 0.0)]
        if layer:
            return False  # progress of a slot with no task: nothing to advance
        pending = self._pending
        if slot in pending:  # a repeat raises the kept count
            entry = pending[slot]
            if tokens > entry[KEPT_TOKENS]:
                pending[slot] = (tokens, entry[SINCE], entry[WALL])
            return False
        decision_clock = self._decision_clock  # a local: an attribute called as self.x() is not specialized
        now = decision_clock()
        # nothing due to expire, and room (see __init__): kept now, counted by the pending dict (see Tally)
        if now <= self._expire_at and len(pending) < self._buffer_room:
            pending[slot] = (tokens, now, now)
            return False
        out: list[Decision] = []
        now, wall = self._make_room_locked(out)
        pending[slot] = (tokens, now, wall)
        return out

    def register(self, slot: int, need_tokens: int) -> int | None:
        """Register the transfer task for `slot`; recover its pending signal exactly once.

        The recovered signal's tokens are returned (start the send with them; test `is not None`, a signal may
        carry 0 tokens), or the signal goes to `on_recovered` (then None is returned). An exception from
        `on_recovered` propagates: the registration already stands, and a lost send must not be silent.
        Registering a live slot raises ValueError (replacing it would orphan the first task's send); registering
        beyond `max_slots` raises SignalBufferFull. Neither changes anything.
        """
        if not (type(slot) is int and type(need_tokens) is int and slot >= 0 and need_tokens >= 0):
            slot = as_int(slot, "slot")
            need_tokens = as_int(need_tokens, "need_tokens")
        with self._held:
            live = self._live
            pending = self._pending
            entry = pending.get(slot)  # one lookup where a signal waits (`in` then `[]` is two)
            if entry is None:
                if slot in live:
                    raise ValueError(f"slot {slot} is already registered; finish() it before registering it again")
                if len(live) < self._max_slots:
                    live[slot] = [need_tokens, -1, -1]
                    return None
                out = self._refuse_locked(slot, need_tokens)
                then: ReadySignal | str | None = _REFUSE
            else:  # so not live: a slot leaves `pending` before it enters `live`, never after
                decision_clock = self._decision_clock  # a local: an attribute called as self.x() is not specialized
                now = decision_clock()
                tokens = entry[KEPT_TOKENS]
                # the quiet recovery: nothing due to expire, a signal that can be this task's, room, and the caller
                # takes it (see __init__); one compound test, cheaper than the three _register_waiting_locked makes
                if now <= self._expire_at and tokens <= need_tokens and len(live) < self._quiet_room:
                    del pending[slot]
                    live[slot] = [need_tokens, tokens, 0]
                    self._waits.append(now - entry[WALL])  # counts the recovery (see Tally); finish() bounds them
                    return tokens
                out, then = self._register_waiting_locked(slot, need_tokens)
        if out:
            self._describe(out)
        if then is None:
            return None
        if then is _REFUSE:
            raise SignalBufferFull("max_slots", self._max_slots, "finish() every slot whose task ended")
        on_recovered = self._on_recovered
        if on_recovered is None:
            return then.tokens
        on_recovered(then)
        return None

    def finish(self, slot: int) -> None:
        """The task of `slot` finished or failed: unregister it and drop any signal still pending for it."""
        if not (type(slot) is int and slot >= 0):
            slot = as_int(slot, "slot")
        with self._held:
            if len(self._waits) >= FLUSH_AT:  # bounds the waits register() notes: see the class docstring
                self._tally.flush_locked()
            task = self._live.pop(slot, None)
            if slot not in self._pending:
                return
            out: list[Decision] = []
            _, wall = self._now_locked(out)  # expires what is due first: an expired signal is not dropped twice
            entry = self._pending.pop(slot, None)
            if entry is not None:
                self._tally.dropped(FINISHED)
                out.append(decision(sc.SIGNAL_DROPPED_FINISHED, slot, entry[KEPT_TOKENS],
                                    None if task is None else task[NEED], wall - entry[WALL]))
        if out:
            self._describe(out)

    # -- the rare outcomes, under self._lock ----------------------------------------------------------------------

    def _make_room_locked(self, out: list[Decision]) -> tuple[float, float]:
        """The (decision time, wall time) at which a new signal is buffered, once what is due has expired and,
        if `max_pending` signals still wait, the oldest has made room."""
        now, wall = self._now_locked(out)
        pending = self._pending
        if len(pending) >= self._max_pending:
            self._evict_oldest_locked(wall, out)
        if not pending:
            self._expire_at = now + self._ttl
        return now, wall

    def _evict_oldest_locked(self, wall: float, out: list[Decision]) -> None:
        """Overflow: the oldest pending signal makes room.

        A dict keeps a deleted entry's place until it grows again, and finding the oldest walks past those
        places, so a flood that evicts at every call would walk further and further; compacting the dict
        once per len/8 + 64 evictions keeps the walk and the copying each a bounded cost per eviction.
        """
        pending = self._pending
        slot = next(iter(pending))
        entry = pending.pop(slot)
        self._tally.dropped(OVERFLOW)
        out.append(decision(sc.SIGNAL_OVERFLOW, slot, entry[KEPT_TOKENS], None, wall - entry[WALL]))
        self._evicted += 1
        if self._evicted > len(pending) // 8 + 64:
            self._evicted = 0
            kept = list(pending.items())
            pending.clear()
            pending.update(kept)

    def _refuse_locked(self, slot: int, need: int) -> list[Decision]:
        """A registration while `max_slots` tasks are live: counted, described, nothing changed."""
        self._counts[REFUSED] += 1
        return [decision(sc.SIGNAL_REFUSED, slot, None, need, 0.0)]

    def _register_waiting_locked(self, slot: int, need: int) -> tuple[list[Decision], ReadySignal | str | None]:
        """register() of a slot whose signal waits, where the quiet recovery may not apply: refused when
        `max_slots` tasks are live; else what is due expires first (this signal, perhaps), then the signal is
        dropped if it claims more tokens than the task needs, or recovered, with its wall-clock wait."""
        if len(self._live) >= self._max_slots:
            return self._refuse_locked(slot, need), _REFUSE
        out: list[Decision] = []
        _, wall = self._now_locked(out)
        entry = self._pending.pop(slot, None)
        if entry is None or entry[KEPT_TOKENS] > need:
            self._live[slot] = [need, -1, -1]
            if entry is not None:
                self._tally.dropped(INVALID)
                out.append(decision(sc.SIGNAL_DROPPED_INVALID, slot, entry[KEPT_TOKENS], need, wall - entry[WALL]))
            return out, None
        tokens = entry[KEPT_TOKENS]
        waited = wall - entry[WALL]
        self._live[slot] = [need, tokens, 0]
        self._waits.append(waited)  # counts the recovery (see Tally); finish() bounds the waits
        if self._describe_recoveries:
            out.append(decision(sc.SIGNAL_RECOVERED, slot, tokens, need, waited))
        return out, ready_signal(slot, tokens, waited)

    def _expire_locked(self, now: float, wall: float, out: list[Decision]) -> None:
        """Drop the pending signals older than the TTL: the oldest ones, found in one walk from the front."""
        pending = self._pending
        ttl = self._ttl
        expired = []
        self._expire_at = EXPIRY_DUE
        for slot, entry in pending.items():
            if now <= entry[SINCE] + ttl:
                self._expire_at = entry[SINCE] + ttl
                break
            expired.append(slot)
            out.append(decision(sc.SIGNAL_EXPIRED, slot, entry[KEPT_TOKENS], None, wall - entry[WALL]))
        for slot in expired:
            del pending[slot]
        self._tally.dropped(EXPIRED, len(expired))


_renewed_after_fork = renewed_after_fork(lambda buffer: buffer._after_fork_in_child())  # a subclass may renew more
