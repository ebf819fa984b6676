"""The cache lock that guarded KV transfers take.

Three implementations of one small protocol: :class:`ThreadLock` (one process), :class:`ProcessLock`
(several processes on one host: ``fcntl.flock`` plus an in-process mutex) and :class:`NullLock` (unguarded).
Every acquire is timed: a lock that cannot be taken must surface as ``False`` or :class:`LockTimeout`,
never as a worker blocked forever.
"""

from __future__ import annotations

import fcntl
import functools
import os
import re
import stat
import tempfile
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvobs.errors import LockTimeout

__all__ = ["CacheLock", "LockTimeout", "NullLock", "ProcessLock", "ThreadLock"]


@runtime_checkable
class CacheLock(Protocol):
    """What a guarded transfer needs from a lock: timed acquire, release, and how long it has been held."""

    name: str

    def acquire(self, timeout: float | None = None) -> bool:
        """True when acquired, False when ``timeout`` expired (None waits forever, 0 tries once)."""

    def release(self) -> None: ...

    def held_for(self) -> float:
        """Seconds the holder in this process has held the lock; 0.0 when this process does not hold it."""

    def __enter__(self) -> CacheLock: ...

    def __exit__(self, *exc_info: object) -> None: ...


class _ContextLock:
    """``with lock:`` acquires with the lock's default timeout and raises :class:`LockTimeout` on failure."""

    name: str
    timeout: float | None

    if TYPE_CHECKING:

        def acquire(self, timeout: float | None = None) -> bool: ...

        def release(self) -> None: ...

    def __enter__(self) -> _ContextLock:
        if not self.acquire(self.timeout):
            raise LockTimeout(self.name, self.timeout or 0.0)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class ThreadLock(_ContextLock):
    """Excludes threads of one process; uncontended, it costs little more than a bare ``threading.Lock``."""

    def __init__(self, name: str = "thread", timeout: float | None = None) -> None:
        self.name = name
        self.timeout = timeout
        self._lock = threading.Lock()
        self._since = 0.0

    def acquire(self, timeout: float | None = None) -> bool:
        if timeout is None:
            ok = self._lock.acquire()
        else:
            # Untimed try first, then positional arguments: a keyword timeout costs several acquires.
            ok = self._lock.acquire(False) or (timeout > 0 and self._lock.acquire(True, timeout))
        if ok:
            self._since = time.monotonic()
        return ok

    def release(self) -> None:
        self._since = 0.0
        self._lock.release()

    def held_for(self) -> float:
        since = self._since
        return time.monotonic() - since if since else 0.0

    def __repr__(self) -> str:
        return f"ThreadLock({self.name!r})"


class NullLock:
    """No locking at all: the unguarded mode, so callers never branch on whether a lock exists.

    Accepts ``name`` and ``timeout`` only so that every lock class can be built the same way.
    """

    def __init__(self, name: str = "none", timeout: float | None = None) -> None:
        self.name = name
        self.timeout = timeout

    def acquire(self, timeout: float | None = None) -> bool:
        return True

    def release(self) -> None:
        pass

    def held_for(self) -> float:
        return 0.0

    def __enter__(self) -> NullLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def __repr__(self) -> str:
        return f"NullLock({self.name!r})"


_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
_EX_NB = fcntl.LOCK_EX | fcntl.LOCK_NB
_FIRST_SLEEP_S = 50e-6
_MAX_SLEEP_S = 2e-3

# Every open ProcessLock, so a forked child can re-open each one (see _reopen_in_child).
_LOCKS: weakref.WeakSet[ProcessLock] = weakref.WeakSet()


def _default_directory() -> str:
    """``KVOBS_LOCK_DIR``, else ``/dev/shm`` (memory-backed, shared by the host's processes), else tmp."""
    configured = os.environ.get("KVOBS_LOCK_DIR")
    if configured:
        return configured
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def _open_lock_file(path: str, create: bool) -> int:
    """Open the lock file without following a symlink, refusing anything but a regular file.

    A link planted at a predictable path in a shared directory must not make us create or open a file
    elsewhere. ``O_EXCL`` first tells whether we created the file, so only then is its mode forced to 0600.
    """
    try:
        if create:
            try:
                fd = os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                fd = os.open(path, _OPEN_FLAGS)
            else:
                os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
        else:
            fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError as exc:
        if create:
            raise
        raise FileNotFoundError(
            exc.errno,
            "cache lock file does not exist; its owner must create it first "
            "(ProcessLock(name) with create=True) before others attach",
            path,
        ) from None
    except OSError as exc:
        if os.path.islink(path):
            raise PermissionError(
                f"refusing cache lock path {path}: a symlink was found at the lock path"
            ) from exc
        if os.path.lexists(path) and not os.path.isfile(path):
            raise PermissionError(f"refusing cache lock path {path}: it is not a regular file") from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PermissionError(f"refusing cache lock path {path}: it is not a regular file")
    return fd


class ProcessLock(_ContextLock):
    """Excludes threads and processes on one host: an in-process mutex, then ``fcntl.flock`` on a file.

    ``flock`` alone is not enough: it belongs to the open file description, so two threads sharing the fd
    both "hold" it. The mutex orders threads; the flock orders processes, and the kernel drops it when a
    holder dies, even by SIGKILL. The file is never unlinked: unlinking would let a new opener lock a
    different inode than a current holder.
    """

    def __init__(
        self,
        name: str,
        *,
        directory: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
        create: bool = True,
    ) -> None:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"invalid cache lock name {name!r}: use a non-empty name of letters, digits, '_', '.', '-'"
            )
        self.name = name
        self.timeout = timeout
        self.directory = os.fspath(directory) if directory is not None else _default_directory()
        self.path = os.path.join(self.directory, f"kvobs-{name}.lock")
        self._fd = _open_lock_file(self.path, create)
        self._mutex = threading.Lock()
        self._since = 0.0
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
        # A spawned worker attaches by name to the same file; it never creates one.
        attach = functools.partial(ProcessLock.attach, directory=self.directory, timeout=self.timeout)
        return attach, (self.name,)

    def acquire(self, timeout: float | None = None) -> bool:
        if timeout is None:
            deadline = None
            self._mutex.acquire()
        else:
            deadline = time.monotonic() + timeout  # the mutex wait counts against the timeout too
            if not (self._mutex.acquire(False) or (timeout > 0 and self._mutex.acquire(True, timeout))):
                return False
        try:
            ok = self._flock(deadline)
        except BaseException:
            self.release()  # LOCK_UN is harmless if the flock was not taken
            raise
        if not ok:
            self._mutex.release()
            return False
        self._since = time.monotonic()
        return True

    def _flock(self, deadline: float | None) -> bool:
        """Poll ``LOCK_NB`` with short exponential backoff: a blocking flock could not honour the deadline."""
        sleep_s = _FIRST_SLEEP_S
        while True:
            try:
                fcntl.flock(self._fd, _EX_NB)
                return True
            except BlockingIOError:
                pass
            if deadline is None:
                time.sleep(sleep_s)
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                time.sleep(min(sleep_s, remaining))
            sleep_s = min(sleep_s * 2, _MAX_SLEEP_S)

    def release(self) -> None:
        self._since = 0.0
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._mutex.release()

    def held_for(self) -> float:
        since = self._since
        return time.monotonic() - since if since else 0.0

    def close(self) -> None:
        """Close the file descriptor (which drops the flock if held). Idempotent."""
        _LOCKS.discard(self)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _reopen_in_child(self) -> None:
        """A forked child shares the parent's open file description, hence its flock: take a fresh one."""
        os.close(self._fd)
        self._fd = -1
        self._mutex = threading.Lock()  # a parent thread may have held it at fork time
        self._since = 0.0
        self._fd = _open_lock_file(self.path, create=False)

    def __repr__(self) -> str:
        return f"ProcessLock({self.name!r}, path={self.path!r})"


def _after_fork_in_child() -> None:
    for lock in list(_LOCKS):
        try:
            lock._reopen_in_child()
        except OSError as exc:
            # Left with fd -1, the lock fails on use rather than silently sharing the parent's flock.
            warnings.warn(f"kvobs: cannot re-open {lock.path} after fork: {exc}", RuntimeWarning)


os.register_at_fork(after_in_child=_after_fork_in_child)
