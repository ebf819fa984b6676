"""The cache lock that guarded KV transfers take.

Three implementations of one small protocol: :class:`ThreadLock` (one process), :class:`ProcessLock`
(several processes on one host: ``fcntl.flock`` plus an in-process mutex) and :class:`NullLock` (unguarded).
Every acquire is timed: a lock that cannot be taken must surface as ``False`` or :class:`LockTimeout`,
never as a worker blocked forever.
"""

from __future__ import annotations

import fcntl
import functools
import operator
import os
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from itertools import compress
from time import perf_counter
from typing import Any, NamedTuple, Protocol, runtime_checkable

from kvobs._runtime.atomic import Held, exit_releasing_when_dropped, push_if, push_unless_raises, release_now
from kvobs._runtime.forks import renewed_after_fork
from kvobs.errors import LockTimeout
from kvobs.locks._lockfile import lock_directory, lock_path, open_lock_file, reopen
from kvobs.locks._polling import poll

__all__ = ["CacheLock", "Claim", "LockTimeout", "NullLock", "ProcessLock", "ThreadLock"]


class Claim(NamedTuple):
    """What one holder asks of the cache lock.

    holder: the path or holder name ("prefetch", "forward"), reported to waiters that conflict with it.
    blocks: sorted distinct block ids the holder touches; empty means the whole cache.
    exclusive: writers (prefetch, the forward pass) exclude everyone; readers (write-back, send) may share
        with other readers where the lock supports shared claims (global locks treat every claim as exclusive).
    """

    holder: str
    blocks: tuple[int, ...] = ()
    exclusive: bool = True


OnConflict = Callable[[str], None]


@runtime_checkable
class CacheLock(Protocol):
    """What a transfer lifecycle needs from a cache lock.

    `acquire_into(held, claim, timeout, on_conflict)` waits up to `timeout` seconds (None: forever, 0: one
    try) and keeps one invariant at every bytecode boundary, asynchronous exceptions included: running the
    undo steps in the deque `held` (newest first, each once) releases exactly what this lock holds for the
    claim. Each step of an acquisition pushes its undo in the same C-level call that performs it (see
    `kvobs._runtime.atomic`). True when the whole claim is held; False on timeout, with `held` left as it was (no
    partial claim). The undo steps may run on any thread. `on_conflict(holder)` is called at most once per
    acquisition, when the claim had to wait, with the holder it waited for ("unknown" when it cannot tell).
    """

    name: str

    def acquire_into(
        self, held: Held, claim: Claim, timeout: float | None, on_conflict: OnConflict | None = None
    ) -> bool: ...

    def overlaps(self, a: Claim, b: Claim) -> bool:
        """Whether a context holding `a` must not wait for `b` (it could wait for itself)."""

    def held_for(self) -> float:
        """Seconds the longest current holder in this process has held the lock; 0.0 when none does."""


UNKNOWN_HOLDER = "unknown"
_CONSTRUCTED = object()  # `acquire()` without a timeout: the one the lock was built with
_NO_WAIT = (False,)
_DIRECT = Claim("direct")


class _PendingExits(threading.local):
    """Per thread, the exits that `with lock:` statements looked up and whose `__enter__` has not yet run, each
    with the undo deque it releases when dropped; newest last (a signal handler's own `with lock:` nests)."""

    def __init__(self) -> None:
        self.exits: list[tuple[weakref.ref, Held]] = []


class _WatchedExit:
    """`_ExclusiveLock.__exit__`: looked up by a `with` statement on a lock, a fresh exit whose death releases
    what that with-statement's `__enter__` took, even when the exit never starts or `__enter__` raises after
    taking the lock (see `kvobs._runtime.atomic.exit_releasing_when_dropped`). Looked up on the class (as
    `contextlib.ExitStack` does), the plain exit releasing what `acquire()` took."""

    def __get__(self, lock: _ExclusiveLock | None, owner: type | None = None) -> Callable[..., Any]:
        if lock is None:
            return _ExclusiveLock._exit_direct
        held: Held = deque()
        _, exit_call, watch = exit_releasing_when_dropped(held, _ExclusiveLock._exit_with, lock, held)
        exits = lock._pending.exits
        while exits and exits[-1][0]() is None:  # exits looked up and dropped without a `with` (hasattr)
            exits.pop()
        exits.append((watch, held))
        return exit_call


class _ExclusiveLock:
    """Shared by ThreadLock and ProcessLock: one exclusive holder at a time, plus a direct `with lock:` API.

    The direct API (`acquire(timeout)`, `release()`, `with lock:`) is for code outside kvobs's guards; it keeps
    its own undo deques, so it is as interrupt-safe as the lifecycle.
    """

    name: str
    timeout: float | None
    # Who holds the mutex since when (perf_counter), for `held_for()` and conflict reports; written by whoever
    # takes it (here, or the fast lane). Nothing to undo: they are read only while the mutex is locked, and
    # the next holder overwrites them.
    holder: str
    held_since: float

    def acquire_into(
        self, held: Held, claim: Claim, timeout: float | None, on_conflict: OnConflict | None = None
    ) -> bool:
        raise NotImplementedError

    def _start_holding(self, held: Held, claim: Claim) -> None:
        self.held_since = perf_counter()
        self.holder = claim.holder

    def _init_holding(self) -> None:
        self.held_since = 0.0
        self.holder = UNKNOWN_HOLDER
        self._direct: Held = deque()
        self._pending = _PendingExits()

    def _mutex_locked(self) -> bool:
        raise NotImplementedError

    def overlaps(self, a: Claim, b: Claim) -> bool:
        return True

    def held_for(self) -> float:
        since = self.held_since
        return perf_counter() - since if since and self._mutex_locked() else 0.0

    def acquire(self, timeout: float | None | object = _CONSTRUCTED) -> bool:
        """Take the lock outside a kvobs guard; True when acquired, False when `timeout` expired (left out:
        the timeout the lock was built with; None waits for ever).

        An exception while waiting (Ctrl-C) leaves nothing held: the steps taken so far are undone here,
        since `with` calls no __exit__ for an __enter__ that raised."""
        if timeout is _CONSTRUCTED:
            timeout = self.timeout
        mine: Held = deque()
        try:
            if not self.acquire_into(mine, _DIRECT, timeout):
                return False
            self._direct = mine
        except BaseException:
            release_now(mine)
            raise
        return True

    def release(self) -> None:
        """Release what `acquire()` took; RuntimeError if it is not held that way."""
        if not self._direct:
            raise RuntimeError(f"release of {self!r}, which acquire() does not hold")
        release_now(self._direct)

    def __enter__(self) -> _ExclusiveLock:
        held = self._held_by_this_with()
        if held is None:  # entered without a `with` statement's lookup of the exit (ExitStack, a direct call)
            acquired = self.acquire(self.timeout)
        else:  # an interrupt from here on drops the with-statement's exit, which releases `held`
            acquired = self.acquire_into(held, _DIRECT, self.timeout)
        if not acquired:
            raise LockTimeout(self.name, self.timeout or 0.0)
        if held is not None:
            self._direct = held  # `release()` from inside the block, or from another thread, as after acquire()
        return self

    def _held_by_this_with(self) -> Held | None:
        """The undo deque of the exit this thread's `with` statement looked up last and still holds."""
        exits = self._pending.exits
        while exits:
            watch, held = exits.pop()
            if watch() is not None:
                return held
        return None

    __exit__ = _WatchedExit()

    def _exit_with(self, held: Held, *exc_info: object) -> None:
        if not held:
            raise RuntimeError(f"release of {self!r}, which this with-statement does not hold")
        release_now(held)

    def _exit_direct(self, *exc_info: object) -> None:
        self.release()


class ThreadLock(_ExclusiveLock):
    """Excludes threads of one process; uncontended, it costs little more than a bare ``threading.Lock``."""

    def __init__(self, name: str = "thread", timeout: float | None = None) -> None:
        self.name = name
        self.timeout = timeout
        self._fresh_mutex()
        _THREAD_LOCKS.add(self)

    def _fresh_mutex(self) -> None:
        """A new mutex: at creation, and in a forked child, where the parent's holder thread does not exist."""
        self._lock = threading.Lock()
        self._undo = (self._lock.release,)
        self._init_holding()

    def _mutex_locked(self) -> bool:
        return self._lock.locked()

    def acquire_into(
        self, held: Held, claim: Claim, timeout: float | None, on_conflict: OnConflict | None = None
    ) -> bool:
        lock = self._lock
        before = len(held)
        held.extendleft(compress(self._undo, map(lock.acquire, _NO_WAIT)))  # push_if, inlined: the hot path
        if len(held) == before:
            if on_conflict is not None:
                on_conflict(self.holder)
            if timeout == 0 or not push_if(held, lock.release, lock.acquire, True, _wait_arg(timeout)):
                return False
        self.held_since = perf_counter()  # _start_holding, inlined on the hot path
        self.holder = claim.holder
        return True

    def uncontended_pair(self) -> tuple[Callable[[bool], bool], Callable[[], None]]:
        """(try_acquire, release) for the fast lane (`kvobs._lifecycle.fast_lane`): C-level calls on the current mutex.
        The lane sets `holder` and `held_since` once it holds."""
        return self._lock.acquire, self._lock.release

    def __repr__(self) -> str:
        return f"ThreadLock({self.name!r})"


class NullLock:
    """No locking at all: the unguarded mode, so callers never branch on whether a lock exists.

    Accepts ``name`` and ``timeout`` only so that every lock class can be built the same way.
    """

    holder = UNKNOWN_HOLDER  # written by the fast lane like any lock's; never read
    held_since = 0.0

    def __init__(self, name: str = "none", timeout: float | None = None) -> None:
        self.name = name
        self.timeout = timeout

    def acquire_into(
        self, held: Held, claim: Claim, timeout: float | None, on_conflict: OnConflict | None = None
    ) -> bool:
        return True

    def overlaps(self, a: Claim, b: Claim) -> bool:
        return False

    def acquire(self, timeout: float | None = None) -> bool:
        return True

    def release(self) -> None:
        pass

    def held_for(self) -> float:
        return 0.0

    def uncontended_pair(self) -> tuple[Callable[[bool], bool], Callable[[], Any]]:
        """(try_acquire, release) for the fast lane: always taken (`not False`), nothing to release."""
        return operator.not_, tuple

    def __enter__(self) -> NullLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def __repr__(self) -> str:
        return f"NullLock({self.name!r})"


def _wait_arg(timeout: float | None) -> float:
    """`threading.Lock.acquire`'s positional timeout: -1 waits forever."""
    return -1 if timeout is None else timeout


_EX_NB = fcntl.LOCK_EX | fcntl.LOCK_NB
_FIRST_SLEEP_S = 50e-6
_MAX_SLEEP_S = 2e-3


class ProcessLock(_ExclusiveLock):
    """Excludes threads and processes on one host: an in-process mutex, then ``fcntl.flock`` on a file.

    ``flock`` alone is not enough: it belongs to the open file description, so two threads sharing the fd
    both "hold" it. The mutex orders threads; the flock orders processes, and the kernel drops it when a
    holder dies, even by SIGKILL. The file is never unlinked: unlinking would let a new opener lock a
    different inode than a current holder. Either lock may be released by another thread than the one
    that took it (a transfer can complete on another thread).
    """

    def __init__(
        self,
        name: str,
        *,
        directory: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
        create: bool = True,
        file: str | os.PathLike[str] | None = None,
    ) -> None:
        """name: the lock's name (its file in kvobs's private lock directory, and its metric label).
        file: instead, a lock file another program made and locks with `flock` (an engine's own lock file), so
        that program and kvobs exclude each other: adopted, never created; a symlink, a file that is not
        regular or one owned by another user is refused (`kvobs.errors.UnsafeLockFile`)."""
        self.name = name
        self.timeout = timeout
        self._adopted = file is not None
        if self._adopted:
            self.path = os.fspath(file)
            self.directory = os.path.dirname(self.path)
        else:
            self.directory = lock_directory(directory)
            self.path = lock_path(name, self.directory)  # InvalidLockName (a ValueError) for a bad name
        self._use_file(open_lock_file(self.path, create=create and not self._adopted, adopt=self._adopted))

    def _use_file(self, fd: int) -> None:
        """Lock through the checked lock file open at `fd` (this lock closes it), re-opened in forked children."""
        self._fd = fd
        self._mutex = threading.Lock()
        self._init_holding()
        _LOCKS.add(self)

    @classmethod
    def attach(
        cls,
        name: str,
        *,
        directory: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
    ) -> ProcessLock:
        """Open a lock file that its owner already created; a missing file is a FileNotFoundError."""
        return cls(name, directory=directory, timeout=timeout, create=False)

    def __reduce__(self) -> tuple[Any, ...]:
        # A spawned worker attaches by name (or adopts by path) to the same file; it never creates one.
        if self._adopted:
            return functools.partial(ProcessLock, file=self.path, timeout=self.timeout), (self.name,)
        attach = functools.partial(ProcessLock.attach, directory=self.directory, timeout=self.timeout)
        return attach, (self.name,)

    def acquire_into(
        self, held: Held, claim: Claim, timeout: float | None, on_conflict: OnConflict | None = None
    ) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout  # the mutex wait counts too
        mutex = self._mutex
        if not push_if(held, mutex.release, mutex.acquire, False):
            if on_conflict is not None:
                on_conflict(self.holder)
                on_conflict = None
            if timeout == 0 or not push_if(held, mutex.release, mutex.acquire, True, _wait_arg(timeout)):
                return False
        if not self._flock_into(held, deadline, on_conflict):
            release_now(held)
            return False
        self._start_holding(held, claim)
        return True

    def _mutex_locked(self) -> bool:
        return self._mutex.locked()

    def _flock_into(self, held: Held, deadline: float | None, on_conflict: OnConflict | None) -> bool:
        """Take the flock (its undo pushed onto `held`), polling until `deadline` while another process has it."""
        attempt = functools.partial(_try_flock, held, self._fd)
        if attempt():
            return True
        if on_conflict is not None:
            on_conflict(UNKNOWN_HOLDER)  # another process: its holder is not visible from here
        return poll(attempt, deadline, _FIRST_SLEEP_S, _MAX_SLEEP_S)

    def close(self) -> None:
        """Close the file descriptor (which drops the flock if held). Idempotent."""
        _LOCKS.discard(self)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _reopen_in_child(self) -> None:
        """A forked child shares the parent's open file description, hence its flock: take a fresh one of
        the same file (the parent's inode, even if the path was unlinked since; never a new file)."""
        inherited, self._fd = self._fd, -1
        self._mutex = threading.Lock()  # a parent thread may have held it at fork time
        self._init_holding()
        try:
            self._fd = reopen(inherited, self.path)
        except OSError as exc:
            # Left with fd -1, the lock fails on use rather than silently sharing the parent's flock.
            warnings.warn(f"kvobs: cannot re-open {self.path} after fork: {exc}", RuntimeWarning)
        finally:
            os.close(inherited)

    def __repr__(self) -> str:
        return f"ProcessLock({self.name!r}, path={self.path!r})"


def _try_flock(held: Held, fd: int) -> bool:
    """One non-blocking flock, its undo pushed in the same C call: False when another description holds it."""
    try:
        push_unless_raises(held, functools.partial(fcntl.flock, fd, fcntl.LOCK_UN), fcntl.flock, fd, _EX_NB)
        return True
    except BlockingIOError:
        return False


# Every ProcessLock, so a forked child re-opens each one's file.
_LOCKS: weakref.WeakSet[ProcessLock] = renewed_after_fork(ProcessLock._reopen_in_child)
# Every ThreadLock, so a forked child gets fresh mutexes (a parent thread may have held one at fork time).
_THREAD_LOCKS: weakref.WeakSet[ThreadLock] = renewed_after_fork(ThreadLock._fresh_mutex)
