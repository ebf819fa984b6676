"""Waiting for the cache lock inside an event loop: no thread per waiter, cancellation-safe.

A waiter tries the lock, then sleeps on a future with exponential backoff (capped, so a lock freed by
another process is noticed soon); a release made through kvobs wakes the waiters of that lock at once.
Nothing is ever acquired while the coroutine is suspended, so cancelling it can never leave a lock held.

A writer on a lock with writer preference (`BlockLock.queue_writer`) stays queued between its tries, as a
waiting sync writer does: otherwise overlapping readers would pass it forever, since each try only finds the
blocks free if the readers happen to leave a gap. What queues it is released when the wait ends, however
it ends.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Callable
from time import monotonic
from typing import Any

from kvobs._runtime.atomic import Held, release_now
from kvobs.locks._cache_lock import CacheLock, Claim, OnConflict

_FIRST_SLEEP_S = 50e-6
_MAX_SLEEP_S = 5e-3

_WAITERS: weakref.WeakKeyDictionary[Any, set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = (
    weakref.WeakKeyDictionary()
)
waiting = 0  # coroutines waiting for any lock now: releases look up waiters only when there are some


async def acquire_async(
    lock: CacheLock, held: Held, claim: Claim, timeout: float | None, on_conflict: OnConflict | None
) -> bool:
    """`lock.acquire_into` for coroutines: True when held, False when `timeout` expired."""
    if lock.acquire_into(held, claim, 0, on_conflict):
        return True
    deadline = None if timeout is None else monotonic() + timeout
    loop = asyncio.get_running_loop()
    waiters = _WAITERS.get(lock)
    if waiters is None:
        waiters = _WAITERS.setdefault(lock, set())
    queue: Callable[[Held, Claim], None] | None = getattr(lock, "queue_writer", None)
    queued: Held = deque()
    global waiting
    waiting += 1
    try:
        return await _wait(lock, held, claim, deadline, loop, waiters, queue, queued)
    finally:
        waiting -= 1
        release_now(queued)


async def _wait(lock: CacheLock, held: Held, claim: Claim, deadline: float | None,
                loop: asyncio.AbstractEventLoop, waiters: set[Any],
                queue: Callable[[Held, Claim], None] | None, queued: Held) -> bool:
    sleep_s = _FIRST_SLEEP_S
    while True:
        if queue is not None:
            queue(queued, claim)  # again each time: a turnstile another writer held may be free now
        delay = sleep_s if deadline is None else min(sleep_s, deadline - monotonic())
        if delay <= 0:
            return False
        wakeup = loop.create_future()
        entry = (loop, wakeup)
        timer = loop.call_later(delay, _resolve, wakeup)
        waiters.add(entry)
        try:
            await wakeup
        finally:
            timer.cancel()
            waiters.discard(entry)
        if lock.acquire_into(held, claim, 0):
            return True
        sleep_s = min(sleep_s * 2, _MAX_SLEEP_S)


def wake_waiters(lock: Any) -> None:
    """Tell coroutines waiting for `lock` to try again now (called after kvobs releases it)."""
    waiters = _WAITERS.get(lock)
    if not waiters:
        return
    for loop, wakeup in list(waiters):
        try:
            loop.call_soon_threadsafe(_resolve, wakeup)
        except RuntimeError:  # that loop is closed: its waiter is gone
            waiters.discard((loop, wakeup))


def _resolve(wakeup: asyncio.Future[None]) -> None:
    if not wakeup.done():
        wakeup.set_result(None)
