"""Every error kvobs raises into the engine on purpose, under one base class.

All of them pickle with their fields intact: engines carry exceptions across worker processes
(`multiprocessing`, `concurrent.futures.ProcessPoolExecutor`), and an error that cannot be unpickled turns
into a confusing failure far from its cause.
"""

from __future__ import annotations

from typing import Any


class KVObsError(Exception):
    """Base of every error kvobs raises on purpose; `except kvobs.KVObsError` catches exactly those."""


class TransferRejected(KVObsError, ValueError):
    """A transfer refused before the lock was touched: bad arguments, or a mode the path does not support.

    Raised instead of `assert`, so the guard holds under `python -O`.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"kvobs rejected {path} transfer: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.reason)


class LockTimeout(KVObsError, TimeoutError):
    """The cache lock was not acquired in time."""

    def __init__(self, lock_name: str, waited_s: float, path: str | None = None) -> None:
        where = f" (path={path})" if path else ""
        # One message argument: given several, OSError would read them as (errno, strerror, filename).
        super().__init__(f"cache lock {lock_name!r} not acquired within {waited_s:.3f} s{where}")
        self.lock_name = lock_name
        self.waited_s = waited_s
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        # OSError's own reduce rebuilds from args (the message) and would not call this __init__ correctly.
        return type(self), (self.lock_name, self.waited_s, self.path)


class ReentrantLockError(KVObsError, RuntimeError):
    """A guarded call asked for a lock its own context already holds: waiting would only time out."""

    def __init__(self, lock_name: str, path: str, holder: str) -> None:
        super().__init__(
            f"cache lock {lock_name!r} requested by {path} while this context already holds it for {holder}; "
            "a guarded call must not call another guarded call on the same lock"
        )
        self.lock_name = lock_name
        self.path = path
        self.holder = holder

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.lock_name, self.path, self.holder)


class CorruptKVError(KVObsError, RuntimeError):
    """The 'raise' integrity policy found NaN or Inf in the blocks a transfer touched.

    `result` is the `kvobs.CheckResult` of the check (any object with `bad_block_ids`, `nan_block_ids`,
    `inf_block_ids` and `checked_blocks`).
    """

    shown_ids = 8

    def __init__(self, path: str, result: Any) -> None:
        self.path = path
        self.result = result
        self.bad_block_ids = tuple(result.bad_block_ids)
        shown = ", ".join(map(str, self.bad_block_ids[: self.shown_ids]))
        more = ", ..." if len(self.bad_block_ids) > self.shown_ids else ""
        super().__init__(
            f"corrupt KV cache on path {path!r}: {len(self.bad_block_ids)} of {result.checked_blocks} "
            f"checked blocks hold non-finite values ({len(result.nan_block_ids)} NaN, "
            f"{len(result.inf_block_ids)} Inf); bad block ids: [{shown}{more}]"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.result)
