"""The cache lock taken by a holder that is not a transfer: the GPU worker's forward pass.

Incident 1's lock was removed upstream because it serialised forward passes behind storage I/O and nobody
could see how long the forward pass waited. `obs.locked("forward")` takes the observer's lock with its
timeout and records that wait and hold under `path="forward"`, beside the transfers' own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from time import perf_counter
from typing import TYPE_CHECKING, Any

from kvobs.locks import LockTimeout

if TYPE_CHECKING:
    from kvobs.observer import KVObserver


class LockSection:
    """A decorator and context manager: the observer's lock, timed, released in `finally`."""

    def __init__(self, observer: KVObserver, holder: str) -> None:
        self.observer = observer
        self.holder = holder
        self.children = observer.metrics.lock_children(holder) if observer.metrics is not None else None
        self._acquired_at: ContextVar[tuple[float, ...]] = ContextVar(f"kvobs.locked.{holder}", default=())

    def __enter__(self) -> LockSection:
        obs = self.observer
        t0 = perf_counter()
        acquired = obs.lock.acquire(obs.lock_timeout)
        t1 = perf_counter()
        self._record("wait", t1 - t0)
        if not acquired:
            self._record("timeout", 0)
            raise LockTimeout(obs.lock.name, t1 - t0, self.holder)
        self._acquired_at.set(self._acquired_at.get() + (t1,))
        return self

    def __exit__(self, *exc_info: object) -> None:
        stack = self._acquired_at.get()
        self._acquired_at.set(stack[:-1])
        self.observer.lock.release()
        self._record("hold", perf_counter() - stack[-1])

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def locked(*args: Any, **kwargs: Any) -> Any:
            with self:
                return func(*args, **kwargs)

        return locked

    def _record(self, what: str, seconds: float) -> None:
        if self.children is None:
            return
        wait, hold, timeouts = self.children
        try:
            if what == "wait":
                wait.observe(seconds)
            elif what == "hold":
                hold.observe(seconds)
            else:
                timeouts.inc()
        except Exception:  # noqa: BLE001 - telemetry never breaks the engine
            self.observer.metrics.count_telemetry_error("metrics")
