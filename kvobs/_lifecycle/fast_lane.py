"""The transfer lifecycle's fast path: how a `Transfer` holds the lock for a synchronous guarded call that names
at most block ids, keys, `is_sync`, a byte count and a request id, on a lock whose uncontended acquire is one C
call (ThreadLock, NullLock).

Why: the general path (transfer.py) gives every transfer an undo deque, a one-shot release and an entry in the
open-transfer table, because such a transfer may end on another thread, later, or by key. A call that holds the
lock only while it runs needs none of that, only the same guarantees, which this path keeps with one reusable
Slot per thread and lock instead of per-call bookkeeping. The call is still a `Transfer` (validated by the same
checks, recorded through the same `Recorder.ended`); only who takes and releases its lock differs, and a
guard's calls on one thread reuse one transfer, which only the call that ended it hands on (`Slot.spare`):

- Acquire and record in one C call: `next(slot.arm)` runs `try_acquire(False)` and stores the lock's
  release (NOOP when the lock was busy) in `slot.pending` under a fresh key, so an interrupt right after
  finds the release recorded (see `kvobs._runtime.atomic` for why that matters).
- Release once, from any thread, in one C call: `all(slot.drain)` pops the newest entry and calls it; it
  raises KeyError when nothing is left, that is when the deadline thread took the release first. Whoever
  pops the release ends the transfer: the pop is its one-shot token.
- The deadline thread takes an expired call's release by that call's key, so never a later call's.

A traced call starts its span once it holds (its wait is none) and runs with the span current, as on the
general path; the current context is read once, as the span's parent and as the context it is made current
in. Everything else goes to the general path, which decides as it always does: a busy lock (it waits, times
out, counts the conflict), a guarded call nested in another (refused as re-entry), and values that do not
validate (rejected, counted and logged there).
"""

from __future__ import annotations

import itertools
import operator
import threading
import weakref
from collections.abc import Callable
from inspect import isawaitable
from time import perf_counter
from typing import Any

from opentelemetry.context import get_current

from kvobs import semconv as sc
from kvobs._lifecycle.transfer import ABANDONED, DONE, FAILED, HELD, Transfer, fast_path_transfer
from kvobs._lifecycle.validation import resolve_blocks, validate_keys, validate_nbytes, validate_sync
from kvobs._runtime.atomic import CALL
from kvobs._runtime.forks import renewed_after_fork
from kvobs.locks import _async_wait as async_wait
from kvobs.telemetry._tracing import call_in_span

FAST_SPECS = frozenset({"block_ids", "keys", "sync", "nbytes", "request_id"})
NOOP: Callable[[], Any] = bool  # what `arm` stores when the lock was busy; returns False, so `all()` stops
_SECOND = operator.itemgetter(1)


class Slot:
    """One thread's fast-path calls on one lock, reused call after call. `t`, the call's Transfer with its
    `t_begin`, is set before `arm` runs, so whoever sees a release in `pending` reads that call's transfer,
    or a later call's.

    `spare`: the transfer of each guard's last call that this thread ended ok and recorded, for that guard's
    next call here to reuse (keyed by the route of a guard naming nothing, by the validator of one naming
    values, whose calls set all of them). A call owns the transfer it pops (one C call, so a guarded call
    made in a signal handler or a finalizer on this thread finds none and builds its own); only the call
    that ended its own transfer puts it back. One that failed (it holds the error), was abandoned (the
    deadline thread records it), was traced (its span), or was interrupted before its end is never put
    back: the next call builds a new one. Nothing outside kvobs ever holds a fast-path transfer (hooks get
    a TransferRecord, no error names it).
    """

    __slots__ = ("__weakref__", "arm", "drain", "pending", "release", "spare", "t")

    def __init__(self, try_acquire: Callable[[bool], bool], release: Callable[[], Any]) -> None:
        pending: dict[int, Callable[[], Any]] = {}
        self.pending = pending
        self.release = release
        outcome = {True: release, False: NOOP}
        self.arm = map(pending.setdefault, itertools.count(),
                       map(outcome.__getitem__, map(try_acquire, itertools.repeat(False))))
        self.drain = map(CALL, map(_SECOND, map(dict.popitem, itertools.repeat(pending))))
        self.t: Transfer | None = None  # the call that holds, or held last
        self.spare: dict[Any, Transfer] = {}

    def holds(self) -> bool:
        return self.release in self.pending.values()

    # `route`, `path` and `claim` describe the call that holds: read only through a slot that held at some point.
    @property
    def route(self) -> Any:
        return None if self.t is None else self.t.route

    @property
    def path(self) -> str:
        return self.t.path

    @property
    def claim(self) -> Any:
        return self.t.route.whole_cache

    def expired_keys(self, now: float) -> list[int]:
        """Keys of held releases whose call is past its deadline. `pending` is read first: a call sets `t`
        before it arms, so a key read here is judged by its own deadline or a later one."""
        keys = [key for key, undo in list(self.pending.items()) if undo is self.release]
        t = self.t
        return keys if keys and t.t_begin + t.route.deadline_s <= now else []


class FastLane:
    """The fast-path slots of one lock in this process, one per thread."""

    def __init__(self, lock: Any) -> None:
        self._lock = weakref.ref(lock)  # the lock's own table of lanes holds this lane; no cycle through it
        self._renew()
        _LANES.add(self)

    def _renew(self) -> None:
        """At creation, and in a forked child: the parent's threads and their slots are not the child's."""
        self.local = threading.local()
        self.slots: weakref.WeakSet[Slot] = weakref.WeakSet()

    def new_slot(self) -> Slot:
        """This thread's slot, created on its first fast-path call (after a fork, from the child's fresh mutex)."""
        slot = self.local.slot = Slot(*self._lock().uncontended_pair())
        self.slots.add(slot)
        return slot

    def held_here(self) -> tuple[Slot, ...]:
        """The slot through which this thread holds the lock now, if it does: a guarded call made under it
        would wait for itself (see `kvobs._lifecycle.active`)."""
        slot = getattr(self.local, "slot", None)
        return (slot,) if slot is not None and slot.holds() else ()

    def open_calls(self, route_open: Any, path: str) -> list[Transfer]:
        """The transfers holding the lock now on `path` of the observer whose open table is `route_open`."""
        calls = []
        for slot in list(self.slots):
            t = slot.t
            if t is not None and t.route.open is route_open and t.path == path and slot.holds():
                calls.append(t)
        return calls

    def expired(self, now: float) -> list[ExpiredCall]:
        """Calls past their deadline, each abandoned once (by key) however many observers' tables ask."""
        return [ExpiredCall(s, key) for s in list(self.slots) for key in s.expired_keys(now)]


class ExpiredCall:
    """A fast-path call past its deadline, as the deadline thread sees it."""

    def __init__(self, slot: Slot, key: int) -> None:
        self.slot = slot
        self.key = key
        self.path = slot.path

    def abandon(self) -> None:
        """Release (unless the call ended first: then nothing happens) and record `abandoned`. The slot's
        transfer is read before the release is taken, while the call still holds, so it is that call's."""
        slot = self.slot
        t = slot.t
        undo = slot.pending.pop(self.key, None)
        if undo is None:
            return
        undo()
        t.state = ABANDONED
        t.outcome = sc.OUTCOME_ABANDONED
        _record(t)


def lane_of(route: Any) -> FastLane | None:
    """The fast lane a route's transfers take, or None: for lock holders that are not transfers (no open
    table), and for a lock whose uncontended acquire is more than one C call. The route's open table then
    counts, ages and abandons the lane's calls too."""
    lock = route.lock
    if route.open is None or getattr(lock, "uncontended_pair", None) is None:
        return None
    lane = _BY_LOCK.get(lock)
    if lane is None:
        lane = _BY_LOCK.setdefault(lock, FastLane(lock))
    route.open.watch_lane(lane)
    return lane


def guarded(route: Any, func: Callable[..., Any], resolvers: dict[str, Callable[[tuple, dict], Any]],
            general: Callable[..., Any]) -> Callable[..., Any] | None:
    """`func` guarded through the fast path, handing every call it does not take to `general`; None when no
    call of this guard can take it (a lock without a lane, or a spec the fast path does not validate)."""
    lane = route.lane
    if lane is None or not resolvers.keys() <= FAST_SPECS:
        return None
    validated = _validating(route, resolvers) if resolvers else None
    reuse_key = route if validated is None else validated
    recorder = route.recorder
    local = lane.local
    lock = route.lock
    path = route.path
    tracing = recorder.tracer_source if recorder.traces else None

    def guarded_call(*args: Any, **kwargs: Any) -> Any:
        """Written out flat, and in this order on purpose: see the module docstring. A call under another guarded
        call on this lock finds it busy and goes to the general path, which refuses it as re-entry."""
        try:
            slot = local.slot
        except AttributeError:
            slot = lane.new_slot()
        # nested in this thread's own call (leave that call's transfer alone), or values that do not validate
        if slot.pending:
            return general(*args, **kwargs)
        if validated is None:  # names nothing: the transfer claims the whole cache
            t = slot.spare.pop(route, None)
            if t is None:
                t = reusable_transfer(route)
        else:
            t = validated(args, kwargs, slot.spare)
            if t is None:
                return general(*args, **kwargs)
        t0 = perf_counter()
        t.t_begin = t0
        t.t_acquired = t0  # a free lock at the first try: no wait
        slot.t = t
        span = None
        try:
            if next(slot.arm) is NOOP:
                all(slot.drain)  # nothing held: the general path waits for the lock
                return general(*args, **kwargs)
            lock.holder = path
            lock.held_since = t0
            t.state = HELD
            if tracing is not None and (tracing.tracer is not None or t0 >= tracing.recheck_at):
                context = get_current()
                span = t.span = recorder.start_span(t, context)  # None: no provider after all
            if span is not None:
                result = call_in_span(span, func, args, kwargs, context)
            elif kwargs:
                result = func(*args, **kwargs)
            else:  # no keywords: no dict built to pass them on
                result = func(*args)
            if result is not None and isawaitable(result):
                refuse_awaitable(func, result)
        except BaseException as exc:
            ended_here = True
            try:
                all(slot.drain)
            except KeyError:
                _drop_spares(slot)
                ended_here = False
            if ended_here:
                t.state = FAILED
                t.outcome = sc.OUTCOME_ERROR
                t.error = exc
                _record(t)
            raise
        try:
            all(slot.drain)
        except KeyError:
            _drop_spares(slot)
            return result
        if async_wait.waiting:
            async_wait.wake_waiters(lock)
        t.state = DONE
        t.outcome = sc.OUTCOME_OK
        t.t_end = perf_counter()
        recorder.ended(t)
        if span is None:
            slot.spare[reuse_key] = t
        return result

    return guarded_call


def _validating(route: Any, resolvers: dict[str, Callable[[tuple, dict], Any]]
                ) -> Callable[[tuple, dict, dict[Any, Transfer]], Transfer | None]:
    """Per call: the transfer with its values validated as the general path validates them, or None for the
    general path (a value that does not resolve or validate, which that path then rejects, or an empty list
    of blocks, which claims nothing)."""
    block_ids = resolvers.get("block_ids")
    keys = resolvers.get("keys")
    sync = resolvers.get("sync")
    nbytes = resolvers.get("nbytes")
    request_id = resolvers.get("request_id")
    path = route.path
    capacity = route.capacity
    page_size = route.page_size
    sync_required = route.sync_required

    def new(args: tuple, kwargs: dict, spare: dict[Any, Transfer]) -> Transfer | None:
        try:
            if sync is not None:
                validate_sync(path, sync(args, kwargs), sync_required=sync_required, completes_later=False)
            blocks = None
            if block_ids is not None:
                blocks = resolve_blocks(path, block_ids(args, kwargs), capacity=capacity, page_size=page_size)
                if not blocks.distinct:
                    return None
            given_keys = None if keys is None else keys(args, kwargs)
            validate_keys(path, given_keys, blocks, paired=page_size is None)
            size = None if nbytes is None else nbytes(args, kwargs)
            validate_nbytes(path, size)
            given_request = None if request_id is None else request_id(args, kwargs)
        except Exception:  # noqa: BLE001 - the general path resolves the call again and reports what is wrong
            return None
        t = spare.pop(new, None)  # this guard's last transfer here (`Slot.spare`), which these four overwrite
        if t is None:
            t = reusable_transfer(route)
        t.blocks = blocks
        t.keys = given_keys
        t.nbytes = size
        t.request_id = given_request
        return t

    return new


def reusable_transfer(route: Any) -> Transfer:
    """A transfer for one guard's calls on this thread to reuse (`Slot.spare`). The fields the recorder reads at
    every end are set on it once: read from the transfer itself, each is one specialised load in the
    interpreter, where a class default costs a lookup that misses in the instance first."""
    t = fast_path_transfer(route)
    t.span = None
    t.blocks = None
    t.nbytes = None
    t.requests = None
    t.reported_moved = None
    return t


def _drop_spares(slot: Slot) -> None:
    """The deadline thread released this thread's call and records its transfer. The slot's spare transfers are
    dropped too: a guarded call made in a signal handler on this thread between the call's `slot.t = t` and its
    `arm` may have left its own there, and that is the one the deadline thread read as the call's."""
    slot.spare.clear()


def _record(t: Transfer) -> None:
    """A fast-path transfer that failed or was abandoned, once its lock is released: wake waiting coroutines,
    record."""
    if async_wait.waiting:
        async_wait.wake_waiters(t.route.lock)
    t.t_end = perf_counter()
    t.route.recorder.ended(t)


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
