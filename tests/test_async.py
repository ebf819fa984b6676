"""async def transfers: the span and duration cover the awaited work; cancellation never leaks the lock."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvobs import semconv as sc
from support import lock_is_free, lock_is_free_from_other_thread


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
