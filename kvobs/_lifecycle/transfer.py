"""One transfer from its begin to its end, and the one record of it: every entry point (decorators, `with`,
`obs.begin`, `obs.complete`, `obs.locked`) drives a `Transfer`, and every outcome is recorded from one, through
`Recorder.ended` (or `rejected` / `timed_out`).

The lock is taken and released in one of two places. Here (the general path): a transfer that may wait for
the lock, end on another thread, by key, or at a later step. In `kvobs._lifecycle.fast_lane` (the fast path): a
synchronous guarded call naming only values it can validate, on a lock whose uncontended acquire is one C
call; it holds through a reusable per-thread slot instead of the per-transfer bookkeeping below, and hands
every call it cannot take (a busy lock, re-entry, a value that does not validate) to this path.

States: new -> waiting -> held -> (submitted) -> done | failed | abandoned, or rejected / timed_out.
A transfer may end on another thread than the one that began it (the copy completes in a pool thread, on a
later engine step, on an acknowledgement). Exactly one caller ends it, through a one-shot token, and the
lock is released through the one-shot undo steps of `kvobs._runtime.atomic`, so a late or racing completion changes
nothing and releases nothing twice, and an asynchronous exception can never leak the lock. No transfer
holds its lock past the route's deadline: the deadline thread abandons it.

Integrity checks run when the data is there: the sources of a reading transfer (write-back, send) once the
lock is held and before the copy starts; the destinations of a writing transfer (prefetch) at completion,
on the blocks that actually moved.
"""
from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from time import perf_counter
from types import MethodType
from typing import TYPE_CHECKING, Any

from kvobs import semconv as sc
from kvobs._lifecycle import active, checks
from kvobs._lifecycle.checks import UNSET
from kvobs._lifecycle.validation import (
    Blocks,
    resolve_blocks,
    resolve_requests,
    validate_key,
    validate_keys,
    validate_nbytes,
    validate_sync,
)
from kvobs._runtime.atomic import exit_releasing_when_dropped, one_shot_release
from kvobs.errors import LockTimeout, ReentrantLockError, TransferRejected
from kvobs.locks import _async_wait as async_wait
from kvobs.locks._cache_lock import Claim

if TYPE_CHECKING:
    from kvobs._lifecycle.route import Route

NEW = "new"
WAITING = "waiting"
HELD = "held"
SUBMITTED = "submitted"
DONE = "done"
FAILED = "failed"
ABANDONED = "abandoned"
REJECTED = "rejected"
TIMED_OUT = "timed_out"
_HOLDING = (HELD, SUBMITTED)
_ONE_TOKEN = (True,)
_NEW_OBJECT = object.__new__

CorruptHandler = Callable[["Transfer", tuple[int, ...]], Any]


def fast_path_transfer(route: Route) -> Transfer:
    """A transfer whose lock `kvobs._lifecycle.fast_lane` takes and releases, claiming the whole cache: built without
    `__init__`, whose one-shot token that path does not use (see `Transfer._ending`). That path reuses it for
    one guard's calls on one thread (`fast_lane.Slot.spare`)."""
    t = _NEW_OBJECT(Transfer)
    t.route = route
    t.path = route.path
    t.claim = route.whole_cache
    return t


class _ExitOfWith:
    """`Transfer.__exit__` and `__aexit__`: a with-block's lock is released even when its exit never starts.

    A signal handler that raises (Ctrl-C) runs at the first instruction of any Python function, so it can land
    at the start of the exit before anything there runs, and the with-block's lock would stay held until the
    deadline. The `with` statement looks the exit up before it calls `__enter__` and keeps what it found on the
    interpreter's stack, the only reference, until it has called it. So for a transfer not yet begun, this
    gives it a fresh callable whose death runs the transfer's undo steps (in C: a weak reference's callback,
    sharing the one shot of `_release`). After a complete exit they have run, and nothing happens; after an
    interrupted one the lock is released as the interrupt leaves the with-statement. Looked up on a transfer
    already begun (after `__enter__`, or on `obs.begin`'s), it is the plain method.
    """

    def __init__(self, method: str) -> None:
        self.method = method

    def __get__(self, t: Transfer | None, owner: type | None = None) -> Callable[..., Any]:
        function = getattr(Transfer, self.method)
        if t is None:
            return function
        if t.state != NEW:
            return MethodType(function, t)
        return t._exit_releasing_when_dropped(function)


class _Done:
    """An awaitable already done: the async exit does its work when called, as the sync one (see _ExitOfWith:
    the callable, not a coroutine awaited later, is what must die for the lock to be released)."""

    __slots__ = ()

    def __await__(self) -> Iterator[None]:
        return iter(())


_DONE = _Done()


class Transfer:
    """One transfer. Built by `KVObserver.begin` / `transfer` / `hold`, and by guards for each call.

    Public read-only attributes: `path`, `state`, `outcome`, `error`, `blocks` (validated `Blocks`, or None),
    `request_id`, `key`, `keys`, `bad_block_ids`, `span`, `skipped`.
    """

    # Class-level defaults: a transfer sets only what differs, so creating one stays cheap on the hot path.
    keys: Any = None
    cache: Any = None
    nbytes: int | None = None
    request_id: Any = None
    key: Any = None
    trace_context: dict[str, str] | None = None
    moved_from: Callable[[Any], Any] | None = None
    on_corrupt: CorruptHandler | None = None
    state = NEW
    outcome: str | None = None
    error: BaseException | None = None
    bad_block_ids: tuple[int, ...] = ()
    span: Any = None
    t_begin = t_acquired = t_end = 0.0
    due = float("inf")
    blocks: Blocks | None = None
    requests: dict[Any, int] | None = None  # a batch: each request's block count (`blocks` is their union)
    request_blocks: Any = None  # a batch: the request id -> block ids mapping as given
    claim: Claim | None = None
    skipped_result: Any = UNSET
    _held: Any = ()
    _release: Callable[[], Any] = staticmethod(tuple)  # nothing is held before acquire: a C-level no-op
    _exit_watch: weakref.ref | None = None  # the `with` statement's exit callable, weakly (see _ExitOfWith)
    reported_moved: Blocks | None = None  # the blocks completion said moved (None: all of them)
    cache_info: Any = None  # what validation learned of `cache` (its layout), for the checks
    # the one-shot token of who ends the transfer; a transfer held by the fast path has none of its own (the
    # slot's pending release is its token there), so `complete` and `fail` on it change nothing
    _ending: Iterator[bool] = iter(())

    def __init__(self, route: Route, *, keys: Any = None, cache: Any = None, nbytes: Any = None,
                 request_id: Any = None, key: Any = None, trace_context: Any = None,
                 moved_from: Callable[[Any], Any] | None = None, on_corrupt: CorruptHandler | None = None) -> None:
        """The values are validated by `validate`; None means not given, and leaves the class default. Keywords,
        not a kwargs dict: building a transfer is on every guarded call's path."""
        self.route = route
        self.path = route.path
        self.claim = route.whole_cache  # until validate() finds the transfer's own blocks
        self._ending = iter(_ONE_TOKEN)
        if keys is not None:
            self.keys = keys
        if cache is not None:
            self.cache = cache
        if nbytes is not None:
            self.nbytes = nbytes
        if request_id is not None:
            self.request_id = request_id
        if key is not None:
            self.key = key
        if trace_context is not None:
            self.trace_context = trace_context
        if moved_from is not None:
            self.moved_from = moved_from
        if on_corrupt is not None:
            self.on_corrupt = on_corrupt

    # -- validation: before anything is locked ------------------------------------------------------------

    def validate(self, *, block_ids: Any = UNSET, requests: Any = UNSET, sync: Any = None,
                 group_sizes: Any = None, completes_later: bool = False) -> Transfer:
        """Check every input; a problem is recorded and raised as TransferRejected, with nothing held.

        `requests` (request id -> block ids) makes the transfer a batch: one lock claim and one span for
        several requests, counted per request."""
        route = self.route
        if block_ids is UNSET and requests is UNSET and sync is None and self.keys is None \
                and self.cache is None and self.key is None and self.nbytes is None:
            self.claim = route.whole_cache
            return self  # nothing given: the checks below would end in the same whole-cache claim
        try:
            if sync is not None:
                validate_sync(self.path, sync, sync_required=route.sync_required, completes_later=completes_later)
            if block_ids is not UNSET and requests is not UNSET:
                raise TransferRejected(self.path, "give block_ids or requests (a batch), not both")
            if block_ids is not UNSET:
                self.blocks = resolve_blocks(self.path, block_ids, capacity=route.capacity,
                                             page_size=route.page_size, group_sizes=group_sizes)
            elif requests is not UNSET:
                self.request_blocks = requests
                self.requests, self.blocks = resolve_requests(self.path, requests, capacity=route.capacity,
                                                              page_size=route.page_size)
            if self.keys is not None:
                validate_keys(self.path, self.keys, self.blocks, paired=route.page_size is None and group_sizes is None)
            nbytes = self.nbytes
            if nbytes is not None and (type(nbytes) is not int or nbytes < 0):  # noqa: E721 (bool is an int)
                validate_nbytes(self.path, nbytes)  # says what is wrong (or accepts an int subclass)
            if self.cache is not None and route.policy is not None:
                self.cache_info = route.caches.inspect(self.path, self.cache, self.blocks)
            if self.key is not None:
                validate_key(self.path, self.key, route.open.find if route.open is not None else None)
        except TransferRejected as exc:
            self.reject(exc)
            raise
        blocks = self.blocks
        if route.lock_free:
            self.claim = None
        elif blocks is None:
            self.claim = route.whole_cache
        else:  # an empty list of blocks claims nothing: there is nothing to protect
            self.claim = Claim(self.path, blocks.distinct, not route.reads_blocks) if blocks.distinct else None
        return self

    def reject(self, exc: BaseException) -> None:
        """Refused before holding anything (bad input, re-entry): recorded once, nothing to release."""
        mine: list = []
        mine.extend(islice(self._ending, 1))
        if mine:
            self.state = REJECTED
            self.outcome = sc.OUTCOME_REJECTED
            self.error = exc
            self.route.recorder.rejected(self)

    # -- acquisition ----------------------------------------------------------------------------------------

    def acquire(self, *, skippable: bool = False) -> None:
        """Wait for the lock (timed), then check the sources of a reading transfer.

        From then on the transfer is abandoned if it has not ended within the route's deadline, whether its
        copy goes on elsewhere or the issuing call itself hangs: no lock is held longer than that.
        skippable: the caller can leave its copy out when the sources are corrupt (a decorated call);
        `skipped` then says so, instead of CorruptKVError being raised.
        """
        route = self._start_waiting()
        claim = self.claim
        acquired = claim is None or route.lock.acquire_into(self._held, claim, route.lock_timeout, route.conflicted)
        self._after_wait(acquired, skippable)

    async def acquire_async(self, *, skippable: bool = False) -> None:
        """`acquire` without blocking the event loop; cancelling it never leaves the lock held."""
        route = self._start_waiting()
        acquired = self.claim is None or await async_wait.acquire_async(
            route.lock, self._held, self.claim, route.lock_timeout, route.conflicted
        )
        self._after_wait(acquired, skippable)

    def _start_waiting(self) -> Route:
        route = self.route
        if not route.lock_free and (active.ACTIVE.get() or route.lane is not None and route.lane.held_here()):
            self._refuse_reentry()
        watch = self._exit_watch
        if watch is None or watch() is None:  # no live with-statement exit set up the undo steps
            held = self._held = deque()
            self._release = one_shot_release(held)
        self.state = WAITING
        recorder = route.recorder
        if recorder.traces:  # as the fast path: no call into the recorder while no tracer is set up
            tracing = recorder.tracer_source
            if tracing.tracer is not None or perf_counter() >= tracing.recheck_at:
                self.span = recorder.start_span(self)
        self.t_begin = perf_counter()
        return route

    def _refuse_reentry(self) -> None:
        lock = self.route.lock
        lane = self.route.lane
        for other in active.ACTIVE.get() + (lane.held_here() if lane is not None else ()):
            if self.claim is None or other.claim is None:
                continue  # claims nothing: cannot wait for itself
            if other.route.lock is lock and other.holds() and lock.overlaps(other.claim, self.claim):
                exc = ReentrantLockError(lock.name, self.path, other.path)
                self.reject(exc)
                raise exc

    def _after_wait(self, acquired: bool, skippable: bool) -> None:
        self.t_acquired = now = perf_counter()
        if not acquired:
            self._time_out()
        route = self.route
        self.state = HELD
        table = route.open
        if table is not None:
            if not table.enter(self._held, self):  # another open transfer has its key
                self._release()
                exc = TransferRejected(self.path, f"a {self.path} transfer is already open under key {self.key!r}")
                self.reject(exc)
                raise exc
            self.due = now + route.deadline_s
        if route.reads_blocks and route.policy is not None:
            self.skipped_result = checks.replacement(self, self.blocks, can_replace=skippable)

    def _time_out(self) -> None:
        route = self.route
        waited = self.t_acquired - self.t_begin
        exc = LockTimeout(route.lock.name, waited, self.path)
        mine: list = []
        mine.extend(islice(self._ending, 1))
        self._release()
        if mine:
            self.state = TIMED_OUT
            self.outcome = sc.OUTCOME_TIMEOUT
            self.error = exc
            self.t_end = self.t_acquired
            route.recorder.timed_out(self)
        raise exc

    def carrier(self) -> dict[str, str]:
        """This transfer's W3C trace context, to send with the transfer's metadata to the receiving node,
        whose `obs.begin("receive", ..., trace_context=...)` continues the same trace. Empty when not traced."""
        return self.route.recorder.carrier(self.span)

    def holds(self) -> bool:
        """Whether this transfer holds its lock now."""
        return self.state in _HOLDING and bool(self._held)

    def release_lock(self) -> None:
        """Release the lock now; the transfer stays open until it is completed, failed or abandoned. For a copy
        that needs its claim only while it is launched (a layer-wise send, whose next layer must not queue behind
        a forward pass waiting for this claim), its sources checked again at completion (`check_copied`)."""
        self._release()  # the lock and the open-transfers entry, in C; the entry alone is made again
        held = self._held = deque()
        self._release = one_shot_release(held)
        table = self.route.open
        if table is not None and self.outcome is None:
            table.enter(held, self)
        if async_wait.waiting:
            async_wait.wake_waiters(self.route.lock)

    @property
    def skipped(self) -> bool:
        """The sources were corrupt and the policy chose to leave the copy out (see `skip()`)."""
        return self.skipped_result is not UNSET

    # -- the code running under the transfer -----------------------------------------------------------------

    def returned(self, result: Any, completes_later: bool) -> Any:
        """The issuing call returned `result`: complete now, or leave the transfer open until `complete()`
        arrives from elsewhere or the deadline passes."""
        if not completes_later:
            return self.complete(result)
        self.submitted()
        return result

    def submitted(self) -> None:
        """The issuing code is done and the copy goes on elsewhere, until `complete()` or the deadline."""
        if self.state == HELD:
            self.state = SUBMITTED

    # -- `with obs.transfer(...)` / `async with` ------------------------------------------------------------

    def start(self, *, in_context: bool = False, skippable: bool = False) -> Transfer:
        """Acquire now (`obs.begin`, `with`); if that fails in any way, nothing stays held and the failure is
        recorded. `in_context`: the code that follows runs under the transfer (a with-block)."""
        if self.state != NEW:
            self._refuse_reuse()
        try:
            self.acquire(skippable=skippable)
            if in_context:
                active.enter(self)
        except BaseException as exc:
            self._release()  # first, and in C: an interrupt here must not leave the lock held
            self.fail(exc)
            raise
        return self

    def __enter__(self) -> Transfer:
        return self.start(in_context=True)

    __exit__ = _ExitOfWith("_exit")

    def _exit_releasing_when_dropped(self, exit_function: Callable[..., Any]) -> Callable[..., Any]:
        """The exit a `with` statement calls: its death releases whatever is still held (see _ExitOfWith)."""
        held = self._held = deque()
        self._release, exit_call, self._exit_watch = exit_releasing_when_dropped(held, exit_function, self)
        return exit_call

    def _exit(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """Completes (checking a writing transfer's destinations) or fails; safe in any thread or context. An
        asynchronous exception landing in here fails the transfer, as it fails a decorated call."""
        try:
            if exc is not None:
                self._release()
                self.fail(exc)
            active.forget(self)
            if exc is None:
                self.complete()
        except BaseException as interrupted:
            self._release()  # first, and in C
            self.fail(interrupted)
            raise

    async def __aenter__(self) -> Transfer:
        if self.state != NEW:
            self._refuse_reuse()
        try:
            await self.acquire_async()
            active.enter(self)
        except BaseException as exc:
            self._release()  # first, and in C
            self.fail(exc)
            raise
        return self

    __aexit__ = _ExitOfWith("_aexit")

    def _aexit(self, exc_type: Any, exc: BaseException | None, tb: Any) -> _Done:
        """`_exit`, done now; what `async with` then awaits is already done."""
        self._exit(exc_type, exc, tb)
        return _DONE

    def _refuse_reuse(self) -> None:
        raise RuntimeError(f"{self!r} was already entered or begun; create a new one per transfer")

    def check_copied(self, cache: Any = None, block_ids: Any = None) -> Any:
        """Before ending a reading transfer (write-back, send), check what its copy actually moved: `cache` at
        `block_ids` (the destination, e.g. host pages once the copy is acknowledged), or by default the
        transfer's own sources again. Its sources were checked when the lock was taken; an engine that copies
        later (from a queue, on a stream) carries a NaN written in between unless its lock excludes every
        writer, and only this second look sees it.

        Returns the CheckResult when it found NaN/Inf and the policy acts on it (`raise`, `skip`): take the
        engine's failure path then. None when clean, not checked, or under `count`. A finding is counted,
        logged, put on the span and in `bad_block_ids`."""
        return checks.check_copied(self, cache, block_ids)

    # -- ending: exactly once, from any thread -----------------------------------------------------------

    def complete(self, result: Any = None, *, moved: Any = None) -> Any:
        """The copy is done. Checks the destinations of a writing transfer on the blocks that moved (`moved`,
        else the guard's `result=` spec applied to `result`, else all), releases the lock, records the outcome.

        Returns `result`, or the replacement chosen by the integrity policy (`skip`'s result, `on_corrupt`'s
        return value) when the moved blocks are corrupt; the `raise` policy raises CorruptKVError instead.
        A transfer that already ended (abandoned past its deadline, or completed twice) is left as it is and
        `result` comes back unchanged.
        """
        mine: list = []
        try:
            mine.extend(islice(self._ending, 1))
            if not mine:
                return result
            result = self._finish(result, moved)
        except BaseException as exc:
            if mine:
                self.state = FAILED
                self.outcome = sc.OUTCOME_ERROR
                self.error = exc
            raise
        finally:
            if mine:
                self._release()
                self._ended()
        return result

    def fail(self, error: BaseException) -> bool:
        """The copy failed (or the issuing code raised): release and record `error`. False if already ended."""
        mine: list = []
        try:
            mine.extend(islice(self._ending, 1))
            if mine:
                self.state = FAILED
                self.outcome = sc.OUTCOME_ERROR
                self.error = error
        finally:
            if mine:
                self._release()
                self._ended()
        return bool(mine)

    def abandon(self) -> None:
        """Past its deadline (called by the deadline thread): release, count `abandoned`, log a warning."""
        self._end_as(ABANDONED, sc.OUTCOME_ABANDONED)

    def skip(self) -> Any:
        """End a transfer whose copy was left out (`skipped`); returns the result the policy chose."""
        self._end_as(DONE, sc.OUTCOME_REJECTED)
        return self.skipped_result

    def _end_as(self, state: str, outcome: str) -> None:
        mine: list = []
        try:
            mine.extend(islice(self._ending, 1))
            if mine:
                self.state = state
                self.outcome = outcome
        finally:
            if mine:
                self._release()
                self._ended()

    def _finish(self, result: Any, moved: Any) -> Any:
        route = self.route
        if route.policy is None and moved is None and self.moved_from is None:  # nothing to check or count
            self.state = DONE
            self.outcome = sc.OUTCOME_OK
            return result  # the general path below would end the same way, only later
        if moved is None and self.moved_from is not None:
            moved = self.moved_from(result)
        if moved is not None:
            self.reported_moved = resolve_blocks(self.path, moved, capacity=route.capacity, page_size=route.page_size)
            if self.cache_info is not None:  # and within the cache the check reads: refused by name, not mid-check
                route.caches.inspect(self.path, self.cache, self.reported_moved)
        self.state = DONE
        self.outcome = sc.OUTCOME_OK
        if not route.reads_blocks and route.policy is not None:
            replacement = checks.replacement(self, self.reported_moved or self.blocks, can_replace=True)
            if replacement is not UNSET:
                self.outcome = sc.OUTCOME_REJECTED
                return replacement
        return result

    def _ended(self) -> None:
        if self.outcome is None:  # the ending code was interrupted before it said how it ended
            self.state = FAILED
            self.outcome = sc.OUTCOME_ERROR
        self.t_end = perf_counter()
        if async_wait.waiting:
            async_wait.wake_waiters(self.route.lock)
        self.route.recorder.ended(self)

    def __repr__(self) -> str:
        return f"<kvobs.Transfer {self.path} {self.state} key={self.key!r} request_id={self.request_id!r}>"
