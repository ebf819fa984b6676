"""`with lock.claim(blocks):` on a BlockLock, for code outside kvobs's guards."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from types import MethodType, TracebackType
from typing import TYPE_CHECKING, Any

from kvobs._runtime.atomic import Held, exit_releasing_when_dropped, release_now
from kvobs.errors import LockTimeout
from kvobs.locks._cache_lock import CacheLock, Claim

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+

__all__ = ["BlockClaim"]


class _WatchedExit:
    """`BlockClaim.__exit__`: looked up by a `with` statement on a claim not held, a fresh exit whose death
    releases what `__enter__` takes into the fresh undo deque it installs, even when the exit never starts or
    `__enter__` raises after taking the blocks (see `kvobs._runtime.atomic.exit_releasing_when_dropped`). Looked up on
    a held claim or on the class, the plain exit."""

    def __get__(self, claim: BlockClaim | None, owner: type | None = None) -> Callable[..., Any]:
        if claim is None:
            return BlockClaim._exit
        if claim._held:
            return MethodType(BlockClaim._exit, claim)
        held: Held = deque()
        _, exit_call, _watch = exit_releasing_when_dropped(held, BlockClaim._exit, claim)
        claim._held = held
        return exit_call


class BlockClaim:
    """A claim held from `__enter__` to `__exit__` (or `release()`, from any thread); its undo steps live here,
    so it is as interrupt-safe as a guarded transfer."""

    def __init__(self, lock: CacheLock, claim: Claim, timeout: float | None) -> None:
        self.lock = lock
        self.claim = claim
        self.timeout = timeout
        self._held: Held = deque()

    def __enter__(self) -> Self:
        try:
            acquired = self.lock.acquire_into(self._held, self.claim, self.timeout)
        except BaseException:
            # Ctrl-C during the wait: `with` will not call __exit__ for an __enter__ that raised.
            release_now(self._held)
            raise
        if not acquired:
            raise LockTimeout(self.lock.name, self.timeout or 0.0, self.claim.holder)
        return self

    def _exit(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    __exit__ = _WatchedExit()

    def release(self) -> None:
        """Release the blocks; a no-op once released."""
        release_now(self._held)
