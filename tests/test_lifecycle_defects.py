"""The defects the transfer-lifecycle review measured, each with a test that failed before the lifecycle.

Real threads, real processes and real signals throughout: the interrupt storm is a SIGALRM interval
timer every 30 us whose handler raises, as Ctrl-C's does (pytest-timeout runs with its thread method, so
SIGALRM is free for the tests).
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import signal
import threading
import time

import pytest
import torch
from opentelemetry import trace

import kvobs
from kvobs import semconv as sc
from kvobs.locks import ProcessLock
from support import lock_is_free, lock_is_free_from_other_thread


class Storm(Exception):
    """Raised by the storm's signal handler between two bytecodes of whatever runs."""


def _interrupt_storm(calls, seconds: float = 1.5, interrupted_calls: int = 600,
                     max_seconds: float = 15.0) -> tuple[int, int, int]:
    """Run `calls()` under a SIGALRM every 30 us whose handler raises, for `seconds` and until at least
    `interrupted_calls` were interrupted (at most `max_seconds`, on a very loaded machine); after each call,
    probe the lock. Returns (calls, interrupted, leaked)."""
    armed = False
    done = interrupted = leaked = 0

    def handler(signum, frame):
        if armed:
            raise Storm()

    gc.collect()  # finalizers of other tests' garbage must not run (and be interrupted) during the storm
    gc.disable()
    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 30e-6, 30e-6)
    start = time.monotonic()
    try:
        while (interrupted < interrupted_calls or time.monotonic() - start < seconds) \
                and time.monotonic() - start < max_seconds:
            done += 1
            try:
                armed = True
                calls()
                armed = False
            except Storm:
                armed = False
                interrupted += 1
            if not calls.lock_is_free():
                leaked += 1
                calls.recover()
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, previous)
        gc.enable()
    return done, interrupted, leaked


class _Calls:
    def __init__(self, obs: kvobs.KVObserver, form: str) -> None:
        self.obs = obs
        self.form = form

        @obs.send(block_ids="ids")
        def send(ids):
            return len(ids)

        self.send = send

    def __call__(self) -> None:
        if self.form == "decorator":
            self.send([1, 2])
        else:
            self.obs.begin("send", block_ids=[1, 2]).complete()

    def lock_is_free(self) -> bool:
        return lock_is_free(self.obs.lock)

    def recover(self) -> None:
        for table in self.obs.open.by_path.values():
            for t in list(table.values()):
                t.abandon()


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_interrupt_storm_leaks_no_hold(tmp_path, kind):
    lock = kvobs.ThreadLock() if kind == "thread" else ProcessLock("storm", directory=tmp_path)
    obs = kvobs.KVObserver("storm", lock=lock, enabled=False, integrity=None, lock_timeout=1.0)
    calls, interrupted, leaked = _interrupt_storm(_Calls(obs, "decorator"))
    assert interrupted > 500, (calls, interrupted)
    assert leaked == 0, f"{leaked} of {interrupted} interrupted calls left the lock held"
    assert obs.open.count("send") == 0


def test_interrupt_storm_on_begin_and_complete_loses_nothing_past_the_deadline(tmp_path):
    """`t = obs.begin(...)` then `t.complete()`: kvobs's own code leaks nothing, but an interrupt landing
    between the two (in the caller's code) loses the handle; the deadline then abandons that transfer."""
    records = []
    obs = kvobs.KVObserver("storm", enabled=False, integrity=None, lock_timeout=1.0, deadline=0.2,
                           hooks=[records.append])

    class Calls(_Calls):
        def recover(self) -> None:  # leave a lost handle to the deadline
            deadline = time.monotonic() + 5
            while not lock_is_free(self.obs.lock) and time.monotonic() < deadline:
                time.sleep(0.01)

    calls, interrupted, lost = _interrupt_storm(Calls(obs, "begin"))
    assert interrupted > 500, (calls, interrupted)
    assert lock_is_free(obs.lock) and obs.open.count("send") == 0
    assert sum(r.outcome == sc.OUTCOME_ABANDONED for r in records) == lost


def test_with_block_exited_in_another_thread_releases(cap):
    obs = cap.observer

    def body():
        with obs.transfer("send", block_ids=[1]):
            yield "inside"

    gen = body()
    assert next(gen) == "inside"
    assert not lock_is_free_from_other_thread(obs.lock)
    errors = []

    def finish():
        try:
            next(gen, None)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=finish)
    t.start()
    t.join()
    assert errors == []
    assert lock_is_free(obs.lock)
    assert cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="ok") == 1


def test_with_block_exited_in_a_copied_context_releases(cap):
    obs = cap.observer
    t = obs.transfer("send", block_ids=[1])
    t.__enter__()
    contextvars.copy_context().run(t.__exit__, None, None, None)
    assert lock_is_free(obs.lock)


class BadRepr(Exception):
    def __repr__(self):
        raise RuntimeError("repr fails")


class BadStr(Exception):
    def __str__(self):
        raise RuntimeError("str fails")


@pytest.mark.parametrize("make", [BadRepr, BadStr])
def test_odd_exception_passes_through_unchanged_and_no_span_stays_current(cap, make):
    obs = cap.observer
    raised = make()

    @obs.send(block_ids="ids")
    def send(ids):
        raise raised

    with pytest.raises(make) as info:
        send([1])
    assert info.value is raised
    assert not trace.get_current_span().get_span_context().is_valid
    assert lock_is_free(obs.lock)
    (span,) = cap.spans
    assert span.attributes[sc.ATTR_ERROR_TYPE] == make.__qualname__
    assert cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="error") == 1


def test_ctrl_c_during_the_lock_wait_leaves_no_span_current(cap):
    obs = cap.observer
    assert obs.lock.acquire(0)  # held by the test, so the guarded call waits

    @obs.send(block_ids="ids")
    def send(ids):
        return "sent"

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    timer = threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            send([1])
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, previous)
        obs.lock.release()
    assert not trace.get_current_span().get_span_context().is_valid
    assert lock_is_free(obs.lock)
    assert [s.attributes[sc.ATTR_ERROR_TYPE] for s in cap.spans] == ["KeyboardInterrupt"]


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


def test_generators_are_refused_at_decoration(cap):
    obs = cap.observer

    def gen(ids):
        yield ids

    async def agen(ids):
        yield ids

    for func in (gen, agen):
        with pytest.raises(TypeError, match="generator"):
            obs.send(block_ids="ids")(func)


def test_a_sync_function_returning_a_coroutine_is_refused(cap):
    obs = cap.observer
    ran = []

    async def copy(ids):
        ran.append(ids)

    @obs.send(block_ids="ids")
    def send(ids):
        return copy(ids)

    with pytest.raises(TypeError, match="awaitable"):
        send([1])
    assert ran == []
    assert lock_is_free(obs.lock)
    assert cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="error") == 1


def test_reentry_on_the_same_lock_fails_at_once(cap):
    obs = cap.observer

    @obs.prefetch(block_ids="ids")
    def inner(ids):
        return "inner"

    @obs.write_back(block_ids="ids")
    def outer(ids):
        return inner(ids)

    start = time.monotonic()
    with pytest.raises(kvobs.ReentrantLockError, match="already holds it for write_back"):
        outer([1])
    assert time.monotonic() - start < 1.0  # the lock timeout is 2 s: it did not wait
    assert lock_is_free(obs.lock)
    assert cap.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="rejected") == 1


def test_hooks_run_when_telemetry_is_disabled_and_see_every_outcome(registry):
    records = []
    obs = kvobs.KVObserver("h", enabled=False, integrity=None, lock_timeout=0.2, hooks=[records.append])

    @obs.send(block_ids="ids", request_id="rid")
    def send(rid, ids):
        if rid == "boom":
            raise ValueError("boom")
        return "sent"

    send("ok-1", [1])
    with pytest.raises(ValueError):
        send("boom", [1])
    with pytest.raises(kvobs.TransferRejected):
        send("bad", [1, 1])
    assert obs.lock.acquire(0)
    with pytest.raises(kvobs.LockTimeout):
        send("late", [2])
    obs.lock.release()
    assert [(r.outcome, r.request_id) for r in records] == [
        ("ok", "ok-1"), ("error", "boom"), ("rejected", "bad"), ("timeout", "late")]


@pytest.mark.parametrize("ids", [None, {1, 2}, {1: "a"}, frozenset({3})], ids=["none", "set", "dict", "frozenset"])
def test_block_ids_that_are_not_a_sequence_are_rejected(cap, ids):
    obs = cap.observer
    ran = []

    @obs.send(block_ids="ids", cache="cache")
    def send(ids, cache):
        ran.append(ids)

    with pytest.raises(kvobs.TransferRejected, match="block ids"):
        send(ids, torch.zeros(4, 2))
    assert ran == []


@pytest.mark.parametrize("cache, message", [
    (torch.zeros(8, 2, dtype=torch.int32), "int32"),
    (torch.zeros(8, 2, dtype=torch.bool), "bool"),
    (torch.zeros(8, 2, dtype=torch.complex64), "complex64"),
    (torch.zeros(8, 2, device="meta"), "meta"),
    (torch.zeros(8, 2).to_sparse(), "sparse"),
    (torch.zeros(4, 2), "out of range"),
], ids=["int", "bool", "complex", "meta", "sparse", "too-small"])
def test_misconfigured_cache_is_rejected_before_any_lock_or_copy(cap, cache, message):
    obs = kvobs.KVObserver("c", registry=cap.registry, integrity="raise", lock=cap.observer.lock, lock_timeout=5)
    ran = []

    @obs.prefetch(block_ids="ids", cache="cache")
    def fetch(ids, cache):
        ran.append(ids)

    assert obs.lock.acquire(0)  # a call that reached the lock would wait 5 s and time out
    try:
        with pytest.raises(kvobs.TransferRejected, match=message):
            fetch([1, 6], cache)
    finally:
        obs.lock.release()
    assert ran == []


def test_bad_block_dim_is_rejected_before_the_lock(cap):
    obs = kvobs.KVObserver("d", registry=cap.registry, block_dim=5, lock=cap.observer.lock, lock_timeout=5)

    @obs.send(block_ids="ids", cache="cache")
    def send(ids, cache):
        return "sent"

    assert obs.lock.acquire(0)
    try:
        with pytest.raises(kvobs.TransferRejected, match="block_dim"):
            send([1], torch.zeros(8, 2))
    finally:
        obs.lock.release()
