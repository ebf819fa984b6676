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


class MetricNameConflict(KVObsError, ValueError):
    """The registry already holds metrics named like kvobs's; nothing of kvobs was registered on it."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(
            f"this Prometheus registry already holds metric names kvobs needs ({detail}); nothing of kvobs "
            "was registered on it: unregister those collectors, or give kvobs its own registry "
            "(KVObserver(registry=CollectorRegistry()))"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.detail,)


class DuplicateEngine(KVObsError, ValueError):
    """A second live observer asked for an engine label already used on the same registry."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        super().__init__(
            f"engine label {engine!r} is already used by a live kvobs observer on this registry; two observers "
            "would share its series (and one's gauges would hide the other's): give each observer a distinct "
            f"engine label (e.g. {engine + '-2'!r}), or drop the first observer before creating another"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.engine,)


class MultiprocessDirError(KVObsError, ValueError):
    """PROMETHEUS_MULTIPROC_DIR does not name a directory this process can write its metric files into."""

    def __init__(self, variable: str, path: str, reason: str) -> None:
        self.variable = variable
        self.path = path
        self.reason = reason
        super().__init__(
            f"{variable}={path!r} {reason}: in multiprocess mode every worker writes its metrics there; "
            f"create the directory (writable by this user, emptied before the workers start), or unset "
            f"{variable} for a single process"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.variable, self.path, self.reason)


class UnsafeLockFile(KVObsError, PermissionError):
    """A lock file or lock directory kvobs refuses to use; `reason` says why, `path` says which."""

    def __init__(self, path: str, reason: str) -> None:
        # One message argument: given several, OSError would read them as (errno, strerror, filename).
        super().__init__(f"refusing cache lock path {path}: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.reason)


class InvalidLockName(KVObsError, ValueError):
    """A lock name that cannot become a lock file name (bad characters, or too long for the file system)."""

    def __init__(self, name: object, reason: str) -> None:
        super().__init__(f"invalid cache lock name {name!r}: {reason}")
        self.name = name
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.name, self.reason)


class SignalBufferFull(KVObsError, RuntimeError):
    """A signal buffer refused a call because one of its bounds is reached; the call changed nothing.

    `limit` names the bound (`max_slots` registered tasks, or the step record of a step-aligned buffer) and
    `size` its value. Reaching it means a task is never finished, or `end_step()` is never called.
    """

    def __init__(self, limit: str, size: int, hint: str) -> None:
        super().__init__(f"signal buffer full: {limit}={size} reached; {hint}")
        self.limit = limit
        self.size = size
        self.hint = hint

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (self.limit, self.size, self.hint)


class OFDUnsupported(KVObsError, OSError):
    """This platform has no OFD locks in the layout kvobs packs (it needs 64-bit Linux >= 3.15)."""


class SpanExportFailed(KVObsError):
    """An exporter reported FAILURE for a batch (it raises nothing itself, so this names the kind in logs)."""

    def __init__(self, exporter: str, spans: int, reason: str) -> None:
        super().__init__(f"{exporter} failed to export {spans} spans: {reason}")
        self.exporter = exporter
        self.spans = spans
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.exporter, self.spans, self.reason)
