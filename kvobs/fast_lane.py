"""The transfer lifecycle's fast lane: a synchronous guarded call naming at most block ids, keys, `is_sync`, a
byte count and a request id (`kvobs.lane_values`), on a lock whose uncontended acquire is one C call
(ThreadLock, NullLock), recorded without building a Transfer.

Why: the general lifecycle (transfer.py) builds a Transfer, an undo deque, a one-shot release and an entry
in the open-transfer table for every call, about fifteen Python calls. A call that holds the lock only while
it runs needs none of that, only the same guarantees, which this lane keeps with no object built per call
for the lock. Each thread has one reusable Slot per lock:

- Acquire and record in one C call: `next(slot.arm)` runs `try_acquire(False)` and stores the lock's
  release (NOOP when the lock was busy) in `slot.pending` under a fresh key, so an interrupt right after
  finds the release recorded (see `kvobs.atomic` for why that matters).
- Release once, from any thread, in one C call: `all(slot.drain)` pops the newest entry and calls it; it
  raises KeyError when nothing is left, that is when the deadline thread took the release first.
- The deadline thread takes an expired call's release by that call's key, so never a later call's.

A traced call starts its span once it holds (its wait is none) and runs with the span current, as on the
general path; the current context is read once, as the span's parent and as the context it is made current
in. Everything else goes to the general lifecycle, which decides as it always does: a busy lock (it waits,
times out, counts the conflict) and a guarded call nested in another (refused as re-entry).
"""

from __future__ import annotations

import itertools
import operator
import threading
import weakref
from collections.abc import Callable
from inspect import isawaitable
from time import perf_counter
from typing import Any, Protocol

from opentelemetry.context import get_current

from kvobs import async_wait
from kvobs import semconv as sc
from kvobs.atomic import CALL
from kvobs.forks import renewed_after_fork
from kvobs.telemetry.tracing import call_in_span


class Route(Protocol):
    """What the lane reads of a `kvobs.route.Route` (which builds its lane: no import back)."""

    path: str
    lock: Any
    deadline_s: float
    recorder: Any
    open: Any
    whole_cache: Any


NOOP: Callable[[], Any] = bool  # what `arm` stores when the lock was busy; returns False, so `all()` stops
_SECOND = operator.itemgetter(1)


class Slot:
    """One thread's fast-lane call on one lock, reused call after call. `route` and `t_begin` are set before
    `arm` runs, so whoever sees a release in `pending` reads that call's values, or a later call's."""

    __slots__ = ("__weakref__", "arm", "drain", "given", "pending", "release", "route", "span", "t_begin")

    def __init__(self, try_acquire: Callable[[bool], bool], release: Callable[[], Any]) -> None:
        pending: dict[int, Callable[[], Any]] = {}
        self.pending = pending
        self.release = release
        outcome = {True: release, False: NOOP}
        self.arm = map(pending.setdefault, itertools.count(),
                       map(outcome.__getitem__, map(try_acquire, itertools.repeat(False))))
        self.drain = map(CALL, map(_SECOND, map(dict.popitem, itertools.repeat(pending))))
        self.route: Any = None  # the Route of the call that holds, or held last
        self.t_begin = 0.0
        self.span: Any = None  # the traced call's span, for the deadline thread to end; None between calls
        self.given: Any = None  # the call's validated values, for the record of an abandoned call

    def holds(self) -> bool:
        return self.release in self.pending.values()

    # `path` and `claim` describe the call that holds: read only through a slot that held at some point.
    @property
    def path(self) -> str:
        return self.route.path

    @property
    def claim(self) -> Any:
        return self.route.whole_cache

    def expired_keys(self, now: float) -> list[int]:
        """Keys of held releases whose call is past its deadline. `pending` is read first: a call sets
        `route` and `t_begin` before it arms, so a key read here is judged by its own deadline or a later one."""
        keys = [key for key, undo in list(self.pending.items()) if undo is self.release]
        return keys if keys and self.t_begin + self.route.deadline_s <= now else []


class FastLane:
    """The fast-lane slots of one lock in this process, one per thread."""

    def __init__(self, lock: Any) -> None:
        self._lock = weakref.ref(lock)  # the lock's own table of lanes holds this lane; no cycle through it
        self._renew()
        _LANES.add(self)

    def _renew(self) -> None:
        """At creation, and in a forked child: the parent's threads and their slots are not the child's."""
        self.local = threading.local()
        self.slots: weakref.WeakSet[Slot] = weakref.WeakSet()

    def new_slot(self) -> Slot:
        """This thread's slot, created on its first fast-lane call (after a fork, from the child's fresh mutex)."""
        slot = self.local.slot = Slot(*self._lock().uncontended_pair())
        self.slots.add(slot)
        return slot

    def held_here(self) -> tuple[Slot, ...]:
        """The slot through which this thread holds the lock now, if it does: a guarded call made under it
        would wait for itself (see `kvobs.active`)."""
        slot = getattr(self.local, "slot", None)
        return (slot,) if slot is not None and slot.holds() else ()

    def open_calls(self, route_open: Any, path: str) -> list[Slot]:
        """Slots holding the lock now for a call on `path` of the observer whose open table is `route_open`."""
        return [s for s in list(self.slots)
                if s.route is not None and s.route.open is route_open and s.route.path == path and s.holds()]

    def expired(self, now: float) -> list[ExpiredCall]:
        """Calls past their deadline, each abandoned once (by key) however many observers' tables ask."""
        return [ExpiredCall(s, key) for s in list(self.slots) for key in s.expired_keys(now)]


class ExpiredCall:
    """A fast-lane call past its deadline, as the deadline thread sees it."""

    def __init__(self, slot: Slot, key: int) -> None:
        self.slot, self.key = slot, key
        self.path = slot.path

    def abandon(self) -> None:
        """Release (unless the call ended first: then nothing happens) and record `abandoned`. The slot's values
        are read before the release is taken, while the call still holds, so they are that call's."""
        slot = self.slot
        route: Any = slot.route  # set before the call armed its key
        t_begin, span, given = slot.t_begin, slot.span, slot.given
        undo = slot.pending.pop(self.key, None)
        if undo is None:
            return
        undo()
        slot.span = None
        _record(route, sc.OUTCOME_ABANDONED, t_begin, span, given)


class LaneRecord:
    """What the recorder reads of a fast-lane call that needs more than counting (`Recorder.Ended`). Its lock
    wait is zero: the lane took a free lock at its first try (a busy one sends the call to the general
    lifecycle, which times the wait)."""

    keys = cache = nbytes = request_id = key = trace_context = None
    blocks = reported_moved = requests = request_blocks = None
    bad_block_ids: tuple[int, ...] = ()

    def __init__(self, route: Route, outcome: str, t_begin: float, t_end: float, span: Any = None,
                 error: BaseException | None = None, given: Any = None) -> None:
        self.path = route.path
        self.outcome, self.error, self.span = outcome, error, span
        self.t_begin = self.t_acquired = t_begin
        self.t_end = t_end
        if given is not None:  # the call's validated values (`kvobs.lane_values.LaneValues`)
            self.blocks, self.keys, self.nbytes = given.blocks, given.keys, given.nbytes
            self.request_id = given.request_id


def lane_for(lock: Any) -> FastLane | None:
    """The lock's fast lane, or None for a lock whose uncontended acquire is more than one C call."""
    if getattr(lock, "uncontended_pair", None) is None:
        return None
    lane = _BY_LOCK.get(lock)
    if lane is None:
        lane = _BY_LOCK.setdefault(lock, FastLane(lock))
    return lane


def fast_call(route: Route, lane: FastLane, func: Callable[..., Any], general: Callable[..., Any],
              values: Callable[[tuple, dict], Any] | None = None) -> Callable[..., Any]:
    """`func` guarded through the fast lane, handing every call the lane does not take to `general`.
    `values(args, kwargs)`: the call's validated values (`kvobs.lane_values`), None to hand the call over."""
    recorder, local, lock, path = route.recorder, lane.local, route.lock, route.path
    tracing = recorder.tracer_source if recorder.traces else None

    def guarded(*args: Any, **kwargs: Any) -> Any:
        """Written out flat, and in this order on purpose: see the module docstring. A call under another guarded
        call on this lock finds it busy and goes to the general path, which refuses it as re-entry."""
        slot = getattr(local, "slot", None) or lane.new_slot()
        given = None if values is None else values(args, kwargs)
        # nested in this thread's own call (leave that call's slot values alone), or values that do not validate
        if slot.pending or given is None and values is not None:
            return general(*args, **kwargs)
        slot.route, slot.given, slot.t_begin = route, given, (t0 := perf_counter())
        span = context = None
        try:
            if next(slot.arm) is NOOP:
                all(slot.drain)  # nothing held: the general lifecycle waits for the lock
                return general(*args, **kwargs)
            lock.holder, lock.held_since = path, t0
            if tracing is not None and (tracing.tracer is not None or t0 >= tracing.recheck_at):
                span = slot.span = recorder.start_span(given, context := get_current())  # None: no provider after all
            result = func(*args, **kwargs) if span is None else call_in_span(span, func, args, kwargs, context)
            if result is not None and isawaitable(result):
                refuse_awaitable(func, result)
        except BaseException as exc:
            ended_here = True
            try:
                all(slot.drain)
            except KeyError:  # the deadline thread released it and recorded the call
                ended_here = False
            if ended_here:
                _record(route, sc.OUTCOME_ERROR, t0, span, given, exc)
            raise
        try:
            all(slot.drain)
        except KeyError:
            return result  # abandoned past its deadline: already recorded
        if async_wait.waiting:
            async_wait.wake_waiters(lock)
        slot.span = None  # ended below: never the deadline thread's to end (an untraced call here reads None)
        if recorder.counts_only:
            recorder.counted_ok(t0, perf_counter(), given, span)
        else:
            recorder.ended(LaneRecord(route, sc.OUTCOME_OK, t0, perf_counter(), span, None, given))
        return result

    return guarded


def _record(route: Route, outcome: str, t_begin: float, span: Any, given: Any,
            error: BaseException | None = None) -> None:
    """A fast-lane call that failed or was abandoned, once its lock is released: wake waiting coroutines, record."""
    if async_wait.waiting:
        async_wait.wake_waiters(route.lock)
    route.recorder.ended(LaneRecord(route, outcome, t_begin, perf_counter(), span, error, given))


def refuse_awaitable(func: Callable[..., Any], result: Any) -> None:
    """A synchronous guarded call returned an awaitable (both paths refuse it): the copy it stands for would run
    after the lock is released."""
    close = getattr(result, "close", None)
    if close is not None:
        close()  # never awaited: close it so Python does not warn about it later
    raise TypeError(
        f"{getattr(func, '__qualname__', func)!r} returned an awaitable, which kvobs would run unguarded; "
        "decorate the `async def` that performs the copy instead"
    )


_BY_LOCK: weakref.WeakKeyDictionary[Any, FastLane] = weakref.WeakKeyDictionary()
_LANES: weakref.WeakSet[FastLane] = renewed_after_fork(FastLane._renew)
