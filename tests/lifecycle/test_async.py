"""async def transfers: the span and duration cover the awaited work; cancellation never leaks the lock."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from support import hold_in_thread, lock_is_free, lock_is_free_from_other_thread

import kvobs
from kvobs import semconv as sc
from kvobs.locks._cache_lock import ThreadLock


def test_span_and_duration_cover_the_awaited_work(cap):
    @cap.observer.send(block_ids="ids")
    async def send(ids):
        await asyncio.sleep(0.2)
        return "sent"

    assert asyncio.run(send([1])) == "sent"
    (span,) = cap.spans
    assert (span.end_time - span.start_time) / 1e9 >= 0.2
    assert cap.value(sc.TRANSFER_DURATION_SECONDS + "_sum", path="send", outcome="ok") >= 0.2
    assert cap.value(sc.LOCK_HOLD_SECONDS + "_sum", lock="thread", path="send") >= 0.2


def test_cancelled_during_the_call_releases_the_lock(cap):

    @cap.observer.send(block_ids="ids")
    async def send(ids):
        await asyncio.sleep(10)

    async def main():
        task = asyncio.create_task(send([1]))
        await asyncio.sleep(0.05)
        assert not lock_is_free_from_other_thread(cap.observer.lock)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert lock_is_free(cap.observer.lock)
    assert cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="error") == 1
    assert cap.spans[0].attributes[sc.ATTR_ERROR_TYPE] == "CancelledError"


def test_cancelled_while_waiting_for_the_lock_never_acquires_it_late(cap):
    lock = cap.observer.lock
    holder_release = threading.Event()
    holding = threading.Event()

    def hold():
        lock.acquire()
        holding.set()
        holder_release.wait(5)
        lock.release()

    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait(5)

    @cap.observer.send(block_ids="ids")
    async def send(ids):
        return "sent"

    async def main():
        task = asyncio.create_task(send([1]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        holder_release.set()
        # the executor thread may acquire after the holder lets go; it must give the lock straight back
        for _ in range(100):
            await asyncio.sleep(0.02)
            if lock_is_free(lock):
                return
        raise AssertionError("lock leaked by a cancelled waiter")

    asyncio.run(main())
    holder.join()
    assert lock_is_free(lock)


def test_event_loop_keeps_running_while_waiting_for_the_lock(cap):
    lock = cap.observer.lock
    lock.acquire()
    ticks = []

    @cap.observer.write_back(block_ids="ids")
    async def write(ids):
        return "done"

    async def ticker():
        for _ in range(5):
            ticks.append(1)
            await asyncio.sleep(0.02)
        lock.release()

    async def main():
        return await asyncio.gather(write([1]), ticker())

    assert asyncio.run(main())[0] == "done"
    assert len(ticks) == 5


def test_async_context_manager(cap):
    async def main():
        async with cap.observer.transfer("prefetch", block_ids=[1, 2]):
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert cap.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 1
    assert lock_is_free(cap.observer.lock)


# -- a coroutine cancelled while it waits for the lock, and an event loop that keeps running -----------------


@pytest.mark.parametrize("form", ["decorator", "async with"])
def test_the_span_of_a_task_cancelled_while_waiting_for_the_lock_is_ended(cap, form):
    obs = cap.observer
    release, holder = hold_in_thread(obs.lock)

    @obs.send(block_ids="ids")
    async def send(ids):
        raise AssertionError("never runs: cancelled while waiting")

    async def with_block():
        async with obs.transfer("send", block_ids=[1]):
            raise AssertionError("never runs: cancelled while waiting")

    async def main():
        task = asyncio.create_task(send([1]) if form == "decorator" else with_block())
        await asyncio.sleep(0.05)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
    finally:
        release.set()
        holder.join()
    (span,) = cap.spans
    assert span.end_time is not None
    assert span.attributes[sc.ATTR_ERROR_TYPE] == "CancelledError"
    assert cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="error") == 1
    assert lock_is_free(obs.lock)


class RecordingLock(ThreadLock):
    """A real ThreadLock that notes, per thread, the timeout of every acquisition attempt."""

    def __init__(self, name: str = "thread") -> None:
        super().__init__(name)
        self.attempts: list[tuple[int, float | None]] = []

    def acquire_into(self, held, claim, timeout, on_conflict=None):
        self.attempts.append((threading.get_ident(), timeout))
        return super().acquire_into(held, claim, timeout, on_conflict)


@pytest.mark.parametrize("form", ["decorator", "async with"])
def test_a_waiting_coroutine_only_ever_tries_the_lock_and_lets_the_loop_run(registry, form):
    lock = RecordingLock()
    obs = kvobs.KVObserver("loop", registry=registry, lock=lock, integrity=None, lock_timeout=5.0)
    release, holder = hold_in_thread(lock)
    ticks = []

    @obs.write_back(block_ids="ids")
    async def write(ids):
        return "written"

    async def with_block():
        async with obs.transfer("write_back", block_ids=[1]):
            return "written"

    async def ticker():
        for _ in range(5):
            ticks.append(1)
            await asyncio.sleep(0.01)
        release.set()  # only a loop that keeps running ever lets the holder go

    async def main():
        waiter = write([1]) if form == "decorator" else with_block()
        return await asyncio.gather(waiter, ticker())

    loop_thread = threading.get_ident()
    try:
        assert asyncio.run(main())[0] == "written"
    finally:
        release.set()
        holder.join()
    assert len(ticks) == 5
    on_loop = [timeout for thread, timeout in lock.attempts if thread == loop_thread]
    assert len(on_loop) >= 2  # a try that failed, then one that succeeded after the holder let go
    assert set(on_loop) == {0}  # never a blocking wait on the loop's thread


def test_async_with_gives_the_transfer_itself(checked):
    async def main():
        t = checked.observer.transfer("prefetch", block_ids=[1])
        async with t as entered:
            assert entered is t and entered.state == "held"

    asyncio.run(main())


# -- many waiters, and a waiter whose loop closes ------------------------------------------------------------


def test_sixty_async_waiters_time_out_together_without_executor_threads(registry):
    obs = kvobs.KVObserver("aw", registry=registry, integrity=None, lock_timeout=0.5)

    @obs.send(block_ids="ids")
    async def send(ids):
        return "sent"

    async def main():
        loop = asyncio.get_running_loop()
        assert obs.lock.acquire(0)
        try:
            start = time.monotonic()
            results = await asyncio.gather(*(send([i]) for i in range(60)), return_exceptions=True)
            elapsed = time.monotonic() - start
        finally:
            obs.lock.release()
        assert loop._default_executor is None  # no thread was borrowed to wait  # noqa: SLF001
        return results, elapsed

    threads_before = threading.active_count()
    results, elapsed = asyncio.run(main())
    assert all(isinstance(r, kvobs.LockTimeout) for r in results)
    assert elapsed < 1.5
    assert threading.active_count() <= threads_before + 1  # at most the deadline thread
    assert registry.get_sample_value(sc.LOCK_TIMEOUTS_TOTAL, {"engine": "aw", "lock": "thread", "path": "send"}) == 60


def test_waiter_cancelled_before_the_loop_closes_never_takes_the_lock(cap):
    obs = cap.observer
    assert obs.lock.acquire(0)

    @obs.send(block_ids="ids")
    async def send(ids):
        return "sent"

    loop = asyncio.new_event_loop()
    task = loop.create_task(send([1]))
    loop.run_until_complete(asyncio.sleep(0.05))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        loop.run_until_complete(task)
    loop.close()
    obs.lock.release()
    time.sleep(0.05)
    assert lock_is_free(obs.lock)
    assert lock_is_free_from_other_thread(obs.lock)
