"""Lifecycle behaviours that a sampled mutation run of kvobs.transfer and kvobs.guard showed no test pinned
down: the with-block's check at exit, the tracing context after every form of transfer, the span of a task
cancelled while it waits, and an event loop that keeps running while a guarded coroutine waits.

Each test here fails on a mutant that the other tests let through; tools/mutate.py reruns them.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import sys
import threading
import time
import warnings

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from support import hold_in_thread, lock_is_free, lock_is_free_from_other_thread

import kvobs
import kvobs.fast_lane
from kvobs import active
from kvobs import semconv as sc
from kvobs.block_lock import BlockLock
from kvobs.integrity import CorruptKVError
from kvobs.locks import ThreadLock
from kvobs.testing import capture


def kv_cache(blocks=8):
    return torch.ones(blocks, 2, 4, dtype=torch.float16)


@pytest.fixture
def checked():
    with capture(engine="gaps", integrity="raise", lock_timeout=2.0) as captured:
        yield captured


# -- `with obs.transfer("prefetch", ...)`: the destinations are checked when the block exits -------------------


def test_with_prefetch_checks_the_blocks_it_loaded_on_exit_and_raises_what_it_finds(checked):
    cache = kv_cache()
    with pytest.raises(CorruptKVError) as info, \
            checked.observer.transfer("prefetch", block_ids=[2, 5], cache=cache):
        assert not lock_is_free_from_other_thread(checked.observer.lock)
        cache[5, 1, 3] = float("nan")  # the "load" brings a bad value into a destination block
    assert info.value.bad_block_ids == (5,)
    assert "prefetch" in str(info.value)
    assert lock_is_free(checked.observer.lock)
    assert checked.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="error") == 1
    assert checked.value(sc.NAN_CHECKS_TOTAL, path="prefetch", result="nan") == 1
    (span,) = checked.spans
    assert span.attributes[sc.ATTR_ERROR_TYPE] == "CorruptKVError"


def test_with_prefetch_does_not_look_at_blocks_before_they_are_loaded(checked):
    cache = kv_cache()
    cache[3] = float("inf")  # stale garbage in a destination the prefetch is about to overwrite
    with checked.observer.transfer("prefetch", block_ids=[3], cache=cache):
        cache[3] = 1.0
    assert checked.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 1
    assert checked.value(sc.NAN_CHECKS_TOTAL, path="prefetch", result="clean") == 1


def test_with_prefetch_leaves_blocks_outside_the_transfer_alone(checked):
    cache = kv_cache()
    cache[7] = float("nan")
    with checked.observer.transfer("prefetch", block_ids=[1, 2], cache=cache):
        pass
    assert checked.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 1


def test_async_with_prefetch_checks_on_exit(checked):
    cache = kv_cache()

    async def main():
        async with checked.observer.transfer("prefetch", block_ids=[0, 1], cache=cache):
            await asyncio.sleep(0)
            cache[0, 0, 0] = float("-inf")

    with pytest.raises(CorruptKVError) as info:
        asyncio.run(main())
    assert info.value.bad_block_ids == (0,)
    assert lock_is_free(checked.observer.lock)


# -- the tracing context is the caller's again after every transfer ----------------------------------------


def _decorated_ok(obs):
    @obs.prefetch(block_ids="ids")
    def fetch(ids):
        return trace.get_current_span()

    return fetch([1])


def _decorated_raising(obs):
    @obs.write_back(block_ids="ids")
    def write(ids):
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        write([1])


def _decorated_corrupt(obs):
    cache = kv_cache()
    cache[1] = float("nan")

    @obs.send(block_ids="ids", cache=lambda ids: cache)
    def send(ids):
        raise AssertionError("a corrupt send must not run")

    with pytest.raises(CorruptKVError):
        send([1])


def _decorated_timing_out(obs):
    @obs.prefetch(block_ids="ids")
    def fetch(ids):
        raise AssertionError("never runs: the lock is held")

    assert obs.lock.acquire(0)
    try:
        with pytest.raises(kvobs.LockTimeout):
            fetch([1])
    finally:
        obs.lock.release()


def _in_one_task(coroutine_function, *args):
    """Await the guarded coroutine from a caller in the same task (the engine's step awaiting its send), and
    check the caller's span is current again right after, inside that task."""

    async def caller():
        before = trace.get_current_span()
        try:
            return await coroutine_function(*args)
        finally:
            assert trace.get_current_span() is before

    return asyncio.run(caller())


def _decorated_async(obs):
    @obs.send(block_ids="ids")
    async def send(ids):
        await asyncio.sleep(0)
        return trace.get_current_span()

    return _in_one_task(send, [1])


def _decorated_async_raising(obs):
    @obs.send(block_ids="ids")
    async def send(ids):
        await asyncio.sleep(0)
        raise OSError("peer gone")

    with pytest.raises(OSError, match="peer gone"):
        _in_one_task(send, [1])


def _with_ok(obs):
    with obs.transfer("prefetch", block_ids=[1]):
        pass


def _with_raising(obs):
    with pytest.raises(KeyError), obs.transfer("write_back", block_ids=[1]):
        raise KeyError("boom")


def _begin_complete(obs):
    t = obs.begin("prefetch", block_ids=[1])
    assert t.complete("done") == "done"


def _begin_fail(obs):
    t = obs.begin("send", block_ids=[1])
    assert t.fail(OSError("link down"))


def _begin_complete_later(obs):
    @obs.write_back(block_ids="ids", complete_later="key")
    def write(ids, key):
        return "submitted"

    assert write([1], key="job-1") == "submitted"
    assert obs.open_transfer("write_back", "job-1") is not None  # open until the completion arrives
    assert obs.complete("write_back", "job-1", "stored") == "stored"
    assert obs.open_transfer("write_back", "job-1") is None


FORMS = [_decorated_ok, _decorated_raising, _decorated_corrupt, _decorated_timing_out, _decorated_async,
         _decorated_async_raising, _with_ok, _with_raising, _begin_complete, _begin_fail, _begin_complete_later]


@pytest.mark.parametrize("form", FORMS, ids=[f.__name__.lstrip("_") for f in FORMS])
def test_the_callers_span_is_current_again_after_every_transfer(form):
    with capture(engine="ctx", integrity="raise", lock_timeout=0.2) as cap:
        tracer = cap.provider.get_tracer("engine")
        with tracer.start_as_current_span("engine.step") as outer:
            form(cap.observer)
            assert trace.get_current_span() is outer
        assert not trace.get_current_span().get_span_context().is_valid
        assert lock_is_free(cap.observer.lock)
        kvobs_spans = [s for s in cap.spans if s.name.startswith("kvobs.")]
        assert kvobs_spans, "the transfer recorded no span"
        assert all(s.parent is not None and s.parent.span_id == outer.get_span_context().span_id
                   for s in kvobs_spans)


@pytest.mark.parametrize("form", [_decorated_ok, _decorated_async], ids=["sync", "async"])
def test_the_decorated_call_runs_with_the_transfer_span_current(form):
    with capture(engine="ctx", integrity=None) as cap:
        inside = form(cap.observer)
        (span,) = cap.spans
        assert inside.get_span_context().span_id == span.context.span_id
        assert not trace.get_current_span().get_span_context().is_valid


def test_the_callers_span_is_current_again_when_no_tracer_records(registry):
    obs = kvobs.KVObserver("quiet", registry=registry, enabled=False, integrity=None)
    provider = trace.NoOpTracerProvider()
    with provider.get_tracer("engine").start_as_current_span("engine.step") as outer:
        _decorated_raising(obs)
        _with_ok(obs)
        assert trace.get_current_span() is outer


@pytest.mark.parametrize("form", [_decorated_ok, _decorated_async], ids=["sync", "async"])
def test_a_call_kvobs_makes_no_span_for_runs_under_the_callers_span(registry, form):
    obs = kvobs.KVObserver("quiet", registry=registry, enabled=False, integrity=None)
    caller = TracerProvider().get_tracer("engine")  # the engine traces; kvobs does not
    with caller.start_as_current_span("engine.step") as outer:
        assert form(obs) is outer
        assert trace.get_current_span() is outer


# -- a coroutine cancelled while it waits for the lock ------------------------------------------------------


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


# -- the event loop runs while a guarded coroutine waits for a contended lock -------------------------------


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


# -- nothing of an ended transfer stays in the caller's context -----------------------------------------------


def test_an_ended_transfer_is_not_left_in_the_callers_context(cap):
    """The context's active transfers are for refusing re-entry; one left behind keeps the ended transfer
    (its cache, its span) alive for as long as the caller's context lives."""
    obs = cap.observer

    @obs.send(block_ids="ids", group_sizes="groups")  # naming KV groups: the general lifecycle, not the fast lane
    def send(ids, groups=(1,)):
        assert len(active.ACTIVE.get()) == 1
        return "sent"

    @obs.send(block_ids="ids")
    async def send_async(ids):
        assert len(active.ACTIVE.get()) == 1
        return "sent"

    async def caller():
        assert await send_async([1]) == "sent"
        assert active.ACTIVE.get() == ()
        with pytest.raises(KeyError):
            async with obs.transfer("send", block_ids=[1]):
                raise KeyError("boom")
        assert active.ACTIVE.get() == ()

    assert send([1]) == "sent"
    assert active.ACTIVE.get() == ()
    asyncio.run(caller())
    with obs.transfer("send", block_ids=[1]):
        assert len(active.ACTIVE.get()) == 1
    assert active.ACTIVE.get() == ()


@pytest.mark.parametrize("outer_form", ["with", "decorator"])
def test_reentry_is_refused_through_a_transfer_on_another_lock(registry, outer_form):
    """A (lock 1) runs B (lock 2), which calls C on lock 1: C must be refused at once, not wait for A (its
    own caller) until the timeout. So the context's active transfers keep A while B is added."""
    cache_obs = kvobs.KVObserver("cache", registry=registry, integrity=None, lock_timeout=5.0)
    link_obs = kvobs.KVObserver("link", registry=registry, integrity=None, lock_timeout=5.0)

    @cache_obs.prefetch(block_ids="ids")
    def c(ids):
        return "c"

    @link_obs.send(block_ids="ids")
    def b(ids):
        return c(ids)

    @cache_obs.write_back(block_ids="ids")
    def a(ids):
        return b(ids)

    with pytest.raises(kvobs.ReentrantLockError, match="already holds it for write_back"):
        if outer_form == "decorator":
            a([1])
        else:
            with cache_obs.transfer("write_back", block_ids=[1]):
                b([1])
    assert cache_obs.lock.acquire(0)
    cache_obs.lock.release()
    assert link_obs.lock.acquire(0)
    link_obs.lock.release()


# -- a transfer that names no blocks claims the whole cache, shared for reading paths --------------------------


def test_transfers_naming_no_blocks_share_the_whole_cache_when_they_read_and_exclude_when_they_write(tmp_path,
                                                                                                 registry):
    lock = BlockLock("whole", 16, directory=tmp_path)
    obs = kvobs.KVObserver("whole", registry=registry, integrity=None, lock=lock, lock_timeout=0.2)
    inside, leave = threading.Event(), threading.Event()

    @obs.write_back()
    def write_all():
        inside.set()
        leave.wait(10)

    @obs.send()
    def send_all():
        return "sent"

    @obs.prefetch()
    def fetch_all():
        return "fetched"

    writer = threading.Thread(target=write_all)
    writer.start()
    try:
        assert inside.wait(10)
        assert send_all() == "sent"  # another reader of the whole cache: shared
        with pytest.raises(kvobs.LockTimeout):
            fetch_all()  # a writer of the whole cache: excluded while the reader holds
    finally:
        leave.set()
        writer.join()
    assert fetch_all() == "fetched"
    lock.close()


# -- every input is checked, also when it is the only one given ------------------------------------------------


@pytest.mark.parametrize("values, message", [
    pytest.param({"keys": "abc"}, "keys must be a sequence of storage keys", id="keys"),
    pytest.param({"nbytes": -1}, "nbytes must be a non-negative int", id="nbytes"),
    pytest.param({"key": ["not", "hashable"]}, "is not hashable", id="key"),
    pytest.param({"cache": object()}, "cache", id="cache"),
])
def test_an_input_given_without_block_ids_is_still_checked(checked, values, message):
    with pytest.raises(kvobs.TransferRejected, match=message):
        checked.observer.transfer("write_back", **values)
    assert checked.value(sc.TRANSFERS_TOTAL, path="write_back", outcome="rejected") == 1


def test_sync_given_without_block_ids_is_still_checked(cap):
    @cap.observer.prefetch(sync="is_sync")
    def load(is_sync=True):
        return "loaded"

    assert load(is_sync=True) == "loaded"
    with pytest.raises(kvobs.TransferRejected, match="asynchronous transfers"):
        load(is_sync=False)


def test_a_transfer_of_no_blocks_inside_another_on_the_same_lock_runs(cap):
    """An empty list of blocks claims nothing, so it cannot wait for its caller: no re-entry refusal."""
    obs = cap.observer

    @obs.prefetch(block_ids="ids")
    def inner(ids):
        return "nothing to load"

    @obs.write_back(block_ids="ids")
    def outer(ids):
        return inner([])

    assert outer([1]) == "nothing to load"
    with obs.transfer("write_back", block_ids=[1]):
        assert inner([]) == "nothing to load"
    assert cap.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 2



# -- the skip policy in an async guard ----------------------------------------------------------------------------


def test_an_async_write_back_of_corrupt_blocks_is_skipped_and_never_runs():
    cache = kv_cache()
    cache[3, 0, 1] = float("nan")
    written = []
    with capture(engine="askip", integrity=kvobs.IntegrityPolicy("skip", skip_result="skipped"),
                 lock_timeout=2.0) as cap:
        @cap.observer.write_back(block_ids="ids", cache=lambda ids: cache)
        async def write_back(ids):
            written.append(ids)
            return "stored"

        assert asyncio.run(write_back([2, 3])) == "skipped"
        assert asyncio.run(write_back([4])) == "stored"
        assert written == [[4]]
        assert lock_is_free(cap.observer.lock)
        assert cap.value(sc.TRANSFERS_TOTAL, path="write_back", outcome="rejected") == 1
        assert cap.value(sc.TRANSFERS_TOTAL, path="write_back", outcome="ok") == 1


# -- a second interrupt while the failure is recorded: the lock was released before anything else ------------


def _interrupted(*args, **kwargs):
    raise KeyboardInterrupt  # Ctrl-C again, while the failure is being recorded


def test_an_interrupt_on_entry_then_another_while_failing_leaves_the_lock_free(checked, monkeypatch):
    monkeypatch.setattr(active, "enter", _interrupted)  # Ctrl-C right after the lock was taken
    monkeypatch.setattr(kvobs.transfer.Transfer, "fail", _interrupted)
    with pytest.raises(KeyboardInterrupt), checked.observer.transfer("prefetch", block_ids=[1]):
        raise AssertionError("never entered")
    assert lock_is_free(checked.observer.lock)


def test_an_interrupt_right_after_the_lock_was_taken_is_a_recorded_failure(checked, monkeypatch):
    monkeypatch.setattr(active, "enter", _interrupted)
    with pytest.raises(KeyboardInterrupt), checked.observer.transfer("prefetch", block_ids=[1]):
        raise AssertionError("never entered")
    assert lock_is_free(checked.observer.lock)
    assert checked.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="error") == 1
    (span,) = checked.spans  # ended, with what ended it
    assert span.attributes[sc.ATTR_ERROR_TYPE] == "KeyboardInterrupt"


def test_a_with_block_that_raises_then_an_interrupt_while_failing_leaves_the_lock_free(checked, monkeypatch):
    with pytest.raises(KeyboardInterrupt), checked.observer.transfer("prefetch", block_ids=[1]):
        monkeypatch.setattr(kvobs.transfer.Transfer, "fail", _interrupted)
        raise OSError("the copy failed")
    assert lock_is_free(checked.observer.lock)


# -- a guard whose only spec is `result=`: the blocks that moved are still the ones the result names -----------


@pytest.mark.parametrize("form", ["sync", "async"])
def test_a_guard_naming_only_the_moved_blocks_counts_them(form):
    with capture(engine="gaps", integrity=None) as cap:
        if form == "sync":
            @cap.observer.prefetch(result=lambda loaded: loaded)
            def load():
                return [1, 2, 3]

            assert load() == [1, 2, 3]
        else:
            @cap.observer.prefetch(result=lambda loaded: loaded)
            async def load():
                return [1, 2, 3]

            assert asyncio.run(load()) == [1, 2, 3]
        assert cap.value(sc.TRANSFER_BLOCKS_TOTAL, path="prefetch") == 3


# -- where a transfer is in its lifecycle, as `state` and its repr say --------------------------------------


def test_a_transfer_says_where_it_is_in_its_lifecycle(checked):
    obs = checked.observer
    t = obs.transfer("prefetch", block_ids=[1], key="job-1")
    assert t.state == "new"
    with t:
        assert t.state == "held"
        assert repr(t) == "<kvobs.Transfer prefetch held key='job-1' request_id=None>"
    assert t.state == "done"

    @obs.write_back(block_ids="ids", complete_later="key")
    def store(ids, key):
        return "queued"

    store([2], key="job-2")
    assert obs.open_transfer("write_back", "job-2").state == "submitted"
    obs.complete("write_back", "job-2")
    failed = obs.begin("send", block_ids=[3])
    failed.fail(OSError("link down"))
    assert failed.state == "failed"
    abandoned = obs.begin("receive", block_ids=[4])
    abandoned.abandon()
    assert abandoned.state == "abandoned"


def test_reentry_is_refused_past_an_outer_transfer_that_claims_nothing():
    with capture(engine="gaps", integrity=None, lock_timeout=5.0) as cap:
        obs = cap.observer
        with obs.transfer("send", block_ids=[]), obs.transfer("prefetch", block_ids=[1]), \
                pytest.raises(kvobs.ReentrantLockError):  # at once, not after the 5 s timeout
            obs.transfer("write_back", block_ids=[1]).start()


def test_a_completion_naming_the_moved_blocks_counts_them_without_an_integrity_policy():
    with capture(engine="gaps", integrity=None) as cap:
        cap.observer.begin("prefetch", block_ids=[1, 2, 3]).complete(moved=[2])
        assert cap.value(sc.TRANSFER_BLOCKS_TOTAL, path="prefetch") == 1


def _conflicts(registry) -> float:
    return sum(s.value for f in registry.collect() for s in f.samples if s.name == sc.LOCK_CONFLICTS_TOTAL)


def test_of_two_transfers_that_took_one_key_while_waiting_only_the_first_keeps_it(tmp_path):
    """Both validated while the key was free, then waited for the lock: the second to get its blocks finds
    the key taken, lets its blocks go and is rejected."""
    lock = BlockLock("race", 8, directory=tmp_path)
    with capture(engine="race", integrity=None, lock=lock, lock_timeout=5.0) as cap:
        outcomes: list[object] = []

        def begin(block):
            try:
                outcomes.append(cap.observer.begin("prefetch", block_ids=[block], key="job-1"))
            except kvobs.TransferRejected as exc:
                outcomes.append(exc)

        with lock.claim([]):  # the whole cache: both validate, then wait
            threads = [threading.Thread(target=begin, args=(block,)) for block in (1, 2)]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 10
            while _conflicts(cap.registry) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _conflicts(cap.registry) == 2
        for thread in threads:
            thread.join(10)
        (kept,) = [o for o in outcomes if isinstance(o, kvobs.Transfer)]
        (refused,) = [o for o in outcomes if isinstance(o, kvobs.TransferRejected)]
        assert "already open under key 'job-1'" in str(refused)
        other_block = 3 - kept.blocks.distinct[0]
        with lock.claim([other_block], timeout=0):  # the refused transfer let its block go
            pass
        kept.complete()
    lock.close()


def test_only_the_blocks_that_moved_are_checked_at_completion(checked):
    cache = kv_cache()
    cache[2] = float("nan")  # block 2 was never loaded: its stale contents are not this transfer's doing
    t = checked.observer.begin("prefetch", block_ids=[1, 2], cache=cache)
    assert t.complete("loaded 1", moved=[1]) == "loaded 1"
    assert checked.value(sc.NAN_CHECKS_TOTAL, path="prefetch", result="clean") == 1


def test_a_transfer_naming_no_blocks_checks_nothing_even_with_a_cache(checked):
    cache = kv_cache()
    cache[0] = float("nan")
    with checked.observer.transfer("prefetch", cache=cache):  # no block ids: nothing known to have moved
        pass
    assert checked.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 1
    assert checked.value(sc.NAN_CHECKS_TOTAL, path="prefetch", result="nan") == 0


@pytest.mark.parametrize("option", ["result", "on_corrupt"])
def test_a_guard_option_that_is_not_callable_is_refused_when_the_guard_is_made(checked, option):
    with pytest.raises(TypeError, match=f"{option} must be callable, got 5"):
        checked.observer.prefetch(block_ids="ids", **{option: 5})


@pytest.mark.parametrize("form", ["sync", "async", "fast lane"])
def test_a_decorated_call_that_raises_then_an_interrupt_while_failing_leaves_the_lock_free(checked, monkeypatch,
                                                                                          form):
    obs = checked.observer
    if form == "sync":
        @obs.prefetch(block_ids="ids", group_sizes="groups")  # naming KV groups: the general lifecycle
        def load(ids, groups=(1,)):
            monkeypatch.setattr(kvobs.transfer.Transfer, "fail", _interrupted)
            raise OSError("the copy failed")

        call = load
    elif form == "fast lane":
        @obs.prefetch(block_ids="ids")
        def load_fast(ids):
            monkeypatch.setattr(kvobs.fast_lane, "_record", _interrupted)
            raise OSError("the copy failed")

        call = load_fast
    else:
        @obs.prefetch(block_ids="ids")
        async def load_async(ids):
            monkeypatch.setattr(kvobs.transfer.Transfer, "fail", _interrupted)
            raise OSError("the copy failed")

        def call(ids):
            return asyncio.run(load_async(ids))
    with pytest.raises(KeyboardInterrupt):
        call([1])
    assert lock_is_free(obs.lock)


def test_a_refused_coroutine_is_closed_so_python_never_warns_it_was_not_awaited(checked):
    async def copy():
        return "copied"

    @checked.observer.prefetch(block_ids="ids")
    def submit(ids):
        return copy()  # a sync function handing back the copy: kvobs refuses to leave it unguarded

    message = ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            submit([1])
        except TypeError as exc:
            message = str(exc)
        gc.collect()  # the coroutine, if still open, warns as it is collected
    assert "returned an awaitable" in message
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []


def test_transfers_on_disjoint_blocks_of_a_block_lock_nest(tmp_path):
    lock = BlockLock("nest", 8, directory=tmp_path)
    with capture(engine="nest", integrity=None, lock=lock, lock_timeout=5.0) as cap:
        obs = cap.observer
        with obs.transfer("prefetch", block_ids=[1]), obs.transfer("write_back", block_ids=[2]) as inner:
            assert inner.state == "held"  # other blocks: no wait on itself to refuse
        with obs.transfer("prefetch", block_ids=[1]), pytest.raises(kvobs.ReentrantLockError):
            obs.transfer("write_back", block_ids=[1, 2]).start()
    lock.close()


def test_a_lock_timeout_says_how_long_it_waited(checked):
    obs = checked.observer
    release, holder = hold_in_thread(obs.lock)
    try:
        with capture(engine="short", integrity=None, lock=obs.lock, lock_timeout=0.1) as short, \
                pytest.raises(kvobs.LockTimeout) as info, short.observer.transfer("prefetch", block_ids=[1]):
            raise AssertionError("never entered")
    finally:
        release.set()
        holder.join()
    assert 0.1 <= info.value.waited_s < 5.0


def test_async_with_gives_the_transfer_itself(checked):
    async def main():
        t = checked.observer.transfer("prefetch", block_ids=[1])
        async with t as entered:
            assert entered is t and entered.state == "held"

    asyncio.run(main())


def test_an_async_call_kvobs_makes_no_span_for_detaches_nothing(registry, caplog):
    obs = kvobs.KVObserver("quiet", registry=registry, enabled=False, integrity=None)
    with caplog.at_level("ERROR", logger="opentelemetry.context"):
        _decorated_async(obs)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry")] == []


def _interrupt_at(func, statement: str):
    """A trace function that raises KeyboardInterrupt in `func` just before `statement` runs: Ctrl-C landing
    exactly there, deterministically (an exception raised by a trace function surfaces in the traced frame)."""
    lines, first = inspect.getsourcelines(func)
    (target,) = [first + i for i, line in enumerate(lines) if line.strip() == statement]

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == target:
            sys.settrace(None)
            raise KeyboardInterrupt
        return local

    return lambda frame, event, arg: local if frame.f_code is func.__code__ else None


def test_an_ending_interrupted_before_it_says_how_it_ended_is_recorded_as_a_failure(checked, monkeypatch):
    t = checked.observer.begin("prefetch", block_ids=[1])

    def check_fails(self, result, moved):
        raise OSError("the check could not read the cache")

    monkeypatch.setattr(kvobs.transfer.Transfer, "_finish", check_fails)
    sys.settrace(_interrupt_at(kvobs.transfer.Transfer.complete, "self.state = FAILED"))
    try:
        with pytest.raises(KeyboardInterrupt):
            t.complete()
    finally:
        sys.settrace(None)
    assert (t.state, t.outcome) == ("failed", "error")
    assert checked.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="error") == 1
    assert lock_is_free(checked.observer.lock)
