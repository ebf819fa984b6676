"""`with lock.claim(blocks):` on a BlockLock, for code outside kvobs's guards."""

from __future__ import annotations

from collections import deque
from types import TracebackType
from typing import TYPE_CHECKING

from kvobs.atomic import Held, release_now
from kvobs.errors import LockTimeout
from kvobs.locks import CacheLock, Claim

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+

__all__ = ["BlockClaim"]


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

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def release(self) -> None:
        """Release the blocks; a no-op once released."""
        release_now(self._held)
