"""The guarded call: order of operations, outcomes, metrics, spans and logs, with a real lock."""

from __future__ import annotations

import asyncio
import gc
import subprocess
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
from kvobs import semconv as sc
from kvobs._lifecycle import active
from kvobs.integrity import CorruptKVError
from kvobs.locks._block_lock import BlockLock
from kvobs.testing import capture


class Task:
    def __init__(self, keys, ids):
        self.task_id = "req-1"
        self.keys = keys
        self.gpu_block_ids = ids


class Manager:
    """FastDeploy-shaped: the task carries keys and block ids, `is_sync` says whether the call blocks."""

    def __init__(self, obs):
        self.calls = []

        @obs.prefetch(keys="task.keys", block_ids="task.gpu_block_ids", sync="is_sync", request_id="task.task_id")
        def issue_prefetch_storage_task(self, task, is_sync=True):
            self.calls.append(task.gpu_block_ids)
            return len(task.gpu_block_ids)

        self.issue = issue_prefetch_storage_task.__get__(self)


def test_ok_call_records_metrics_span_and_log(cap):
    mgr = Manager(cap.observer)
    assert mgr.issue(Task(["a", "b"], [3, 4])) == 2
    assert cap.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 1
    assert cap.value(sc.TRANSFER_BLOCKS_TOTAL, path="prefetch") == 2
    assert cap.value(sc.LOCK_WAIT_SECONDS + "_count", lock="thread", path="prefetch") == 1
    assert cap.value(sc.LOCK_HOLD_SECONDS + "_count", lock="thread", path="prefetch") == 1
    assert cap.value(sc.TRANSFERS_IN_FLIGHT, path="prefetch") == 0
    (span,) = cap.spans
    assert span.name == "kvobs.prefetch"
    assert span.attributes[sc.ATTR_BLOCK_IDS] == (3, 4)
    assert span.attributes[sc.ATTR_KEYS] == ("a", "b")
    assert span.attributes[sc.ATTR_REQUEST_ID] == "req-1"
    assert span.attributes[sc.ATTR_OUTCOME] == "ok"
    (log,) = cap.logs
    assert log["event"] == "kvobs._lifecycle.transfer" and log["log_level"] == "debug"
    assert log["trace_id"] == format(span.context.trace_id, "032x")


def test_error_is_reraised_unchanged_and_recorded(cap):
    boom = RuntimeError("storage down")

    @cap.observer.write_back(block_ids="ids")
    def write(ids):
        raise boom

    with pytest.raises(RuntimeError) as info:
        write([1])
    assert info.value is boom
    assert lock_is_free(cap.observer.lock)
    assert cap.value(sc.TRANSFERS_TOTAL, path="write_back", outcome="error") == 1
    (span,) = cap.spans
    assert span.status.status_code.name == "ERROR"
    assert span.attributes[sc.ATTR_ERROR_TYPE] == "RuntimeError"
    assert any(e.name == "exception" for e in span.events)
    assert cap.logs[-1]["log_level"] == "error"


def test_lock_is_held_during_the_call_and_free_after(cap):
    seen = []

    @cap.observer.send(block_ids="ids")
    def send(ids):
        seen.append(lock_is_free_from_other_thread(cap.observer.lock))

    send([0])
    assert seen == [False]
    assert lock_is_free(cap.observer.lock)


def test_lock_timeout_names_lock_path_and_seconds(cap):
    lock = cap.observer.lock
    obs = kvobs.KVObserver("t2", lock=lock, lock_timeout=0.2, registry=cap.registry, integrity=None)

    @obs.prefetch(block_ids="ids")
    def fetch(ids):
        return "never"

    assert lock.acquire(0)
    try:
        t0 = time.perf_counter()
        with pytest.raises(kvobs.LockTimeout) as info:
            fetch([1])
        assert time.perf_counter() - t0 >= 0.19
    finally:
        lock.release()
    msg = str(info.value)
    assert "'thread'" in msg and "prefetch" in msg and " s" in msg
    assert info.value.waited_s >= 0.19
    assert cap.registry.get_sample_value(
        sc.LOCK_TIMEOUTS_TOTAL, {"engine": "t2", "lock": "thread", "path": "prefetch"}) == 1
    assert cap.registry.get_sample_value(
        sc.TRANSFERS_TOTAL, {"engine": "t2", "path": "prefetch", "outcome": "timeout"}) == 1


def test_lock_held_gauge_grows_while_a_holder_is_stuck(cap):
    release = threading.Event()
    entered = threading.Event()

    @cap.observer.write_back(block_ids="ids")
    def slow(ids):
        entered.set()
        release.wait(5)

    t = threading.Thread(target=slow, args=([1],))
    t.start()
    entered.wait(5)
    first = cap.value(sc.LOCK_HELD_SECONDS, lock="thread")
    time.sleep(0.2)
    second = cap.value(sc.LOCK_HELD_SECONDS, lock="thread")
    release.set()
    t.join()
    assert 0 < first < second
    assert second - first >= 0.15
    assert cap.value(sc.LOCK_HELD_SECONDS, lock="thread") == 0


def test_context_manager_forms(cap):
    with cap.observer.transfer("write_back", block_ids=[1, 2], keys=["k1", "k2"]):
        assert not lock_is_free_from_other_thread(cap.observer.lock)
    assert lock_is_free(cap.observer.lock)
    with pytest.raises(ValueError, match="boom"):
        with cap.observer.transfer("send", block_ids=[5]):
            raise ValueError("boom")
    assert lock_is_free(cap.observer.lock)
    assert cap.value(sc.TRANSFERS_TOTAL, path="write_back", outcome="ok") == 1
    assert cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="error") == 1
    with cap.observer.transfer("send", block_ids=[1], request_id="req-9"):
        pass
    assert cap.spans[-1].attributes[sc.ATTR_REQUEST_ID] == "req-9"
    with pytest.raises(kvobs.TransferRejected, match="block ids must be a sequence of ints, got str"):
        with cap.observer.transfer("send", block_ids="ids"):
            pass
    with pytest.raises(TypeError, match="a guard is a decorator"):
        with cap.observer.send(block_ids=[1]):
            pass


def test_with_blocks_from_many_threads_and_a_transfer_entered_once(registry):
    obs = kvobs.KVObserver("shared", registry=registry, lock=None, integrity=None)
    inside = threading.Barrier(2)
    errors = []

    def use():
        try:
            for _ in range(200):
                with obs.transfer("send", block_ids=[1]):
                    pass
            with obs.transfer("send", block_ids=[1]):
                inside.wait(5)  # both threads inside a send at once
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=use) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert registry.get_sample_value(
        sc.TRANSFERS_TOTAL, {"engine": "shared", "path": "send", "outcome": "ok"}) == 402
    t = obs.transfer("send", block_ids=[2])
    with t:
        with pytest.raises(RuntimeError, match="already entered or begun"):
            with t:
                pass


def test_methods_and_callable_specs(cap):
    class Engine:
        def __init__(self):
            self.blocks = [7, 8]

        @cap.observer.send(block_ids=lambda self, **kw: self.blocks, nbytes=lambda self, **kw: 64)
        def send(self, *, layer):
            return layer

    assert Engine().send(layer=3) == 3
    assert cap.value(sc.TRANSFER_BYTES_TOTAL, path="send") == 64
    assert cap.value(sc.TRANSFER_BLOCKS_TOTAL, path="send") == 2


def test_spec_naming_a_missing_parameter_fails_at_decoration(cap):
    with pytest.raises(ValueError, match="has no parameter 'tsk'"):
        @cap.observer.prefetch(block_ids="tsk.gpu_block_ids")
        def fetch(task):
            pass


def test_block_bytes_default_and_capacity(registry):
    obs = kvobs.KVObserver("cap", registry=registry, capacity=10, block_bytes=1024, integrity=None)

    @obs.prefetch(block_ids="ids")
    def fetch(ids):
        pass

    fetch([0, 9])
    assert registry.get_sample_value(sc.TRANSFER_BYTES_TOTAL, {"engine": "cap", "path": "prefetch"}) == 2048
    with pytest.raises(kvobs.TransferRejected, match="out of range for a cache of 10 blocks"):
        fetch([10])


def test_disabled_mode_keeps_validation_and_lock_but_no_telemetry(registry, monkeypatch):
    monkeypatch.setenv("KVOBS_ENABLED", "0")
    obs = kvobs.KVObserver("off", registry=registry, lock_timeout=0.1, integrity=None)
    assert obs.telemetry is False

    @obs.write_back(block_ids="ids")
    def write(ids):
        return "done"

    assert write([1]) == "done"
    with pytest.raises(kvobs.TransferRejected):
        write([-1])
    assert obs.lock.acquire(0)
    try:
        with pytest.raises(kvobs.LockTimeout):
            write([1])
    finally:
        obs.lock.release()
    assert registry.get_sample_value(sc.TRANSFERS_TOTAL, {"engine": "off", "path": "write_back", "outcome": "ok"}) is None


def test_no_lock_observes_only(registry):
    obs = kvobs.KVObserver("obs-only", lock=None, registry=registry, integrity=None)

    @obs.send(block_ids="ids")
    def send(ids):
        return ids

    assert send([1]) == [1]
    assert registry.get_sample_value(
        sc.LOCK_WAIT_SECONDS + "_count", {"engine": "obs-only", "lock": "none", "path": "send"}) == 1


def test_async_rejection_holds_under_python_O(tmp_path):
    script = tmp_path / "o.py"
    script.write_text(
        "import kvobs\n"
        "obs = kvobs.KVObserver('o', integrity=None)\n"
        "@obs.write_back(block_ids='ids', sync='is_sync')\n"
        "def w(ids, is_sync=True): return 1\n"
        "try:\n"
        "    w([1], is_sync=False)\n"
        "except kvobs.TransferRejected as e:\n"
        "    print('REJECTED', e)\n"
        "assert False, 'asserts are stripped under -O'\n"
        "print('OPTIMIZED')\n"
    )
    out = subprocess.run([sys.executable, "-O", str(script)], capture_output=True, text=True, timeout=60)
    assert "REJECTED" in out.stdout and "asynchronous" in out.stdout
    assert "OPTIMIZED" in out.stdout


def test_one_guard_decorates_several_functions(cap):
    guard = cap.observer.send(block_ids="ids")

    @guard
    def first(ids):
        return ids

    @guard
    def second(layer, ids):
        return layer, ids

    assert first([1, 2]) == [1, 2]
    assert second(7, [3]) == (7, [3])
    assert cap.value(sc.TRANSFER_BLOCKS_TOTAL, path="send") == 3


def test_forward_pass_lock_section_is_timed_beside_the_transfers(cap):
    obs = cap.observer
    holding = threading.Event()
    release = threading.Event()

    @obs.locked("forward")
    def execute_model():
        holding.set()
        release.wait(5)
        return "logits"

    results = []
    t = threading.Thread(target=lambda: results.append(execute_model()))
    t.start()
    holding.wait(5)

    @obs.write_back(block_ids="ids")
    def write_back(ids):
        return "stored"

    threading.Timer(0.2, release.set).start()
    assert write_back([1]) == "stored"   # waited behind the forward pass
    t.join()
    assert results == ["logits"]
    assert lock_is_free(obs.lock)
    assert cap.value(sc.LOCK_WAIT_SECONDS + "_sum", lock="thread", path="write_back") >= 0.15
    assert cap.value(sc.LOCK_HOLD_SECONDS + "_sum", lock="thread", path="forward") >= 0.15
    assert cap.value(sc.LOCK_WAIT_SECONDS + "_count", lock="thread", path="forward") == 1
    assert cap.value(sc.TRANSFERS_TOTAL, path="write_back", outcome="ok") == 1

    assert obs.lock.acquire(0)
    try:
        short = kvobs.KVObserver("fw", registry=cap.registry, lock=obs.lock, lock_timeout=0.1, integrity=None)
        with pytest.raises(kvobs.LockTimeout, match="forward"):
            with short.hold("forward"):
                pass
    finally:
        obs.lock.release()
    assert cap.registry.get_sample_value(
        sc.LOCK_TIMEOUTS_TOTAL, {"engine": "fw", "lock": "thread", "path": "forward"}) == 1
    with pytest.raises(ValueError, match="holder='bad holder' is not declared"):
        obs.locked("bad holder")


def test_an_empty_list_of_blocks_claims_nothing(cap, tmp_path):
    """Nothing to protect: an empty transfer or forward step neither takes nor waits for the lock."""
    lock = kvobs.BlockLock("empty", 16, directory=tmp_path)
    obs = kvobs.KVObserver("empty", registry=cap.registry, lock=lock, lock_timeout=0.5, integrity=None)
    whole = obs.begin("prefetch")  # no block ids at all: the whole cache
    with obs.hold("forward", block_ids=[]):
        with obs.transfer("send", block_ids=[]):
            pass
    whole.complete()
    assert lock.blocks_claimed() == {"shared": 0, "exclusive": 0}


@pytest.mark.parametrize("entry", ["decorator", "with", "begin"])
def test_a_block_id_past_a_block_lock_is_rejected_before_locking(tmp_path, entry):
    """The BlockLock knows the cache's size: an id past it is a bad input like any other (TransferRejected,
    counted `rejected`), refused before the lock is touched, with no `capacity=` given."""
    lock = kvobs.BlockLock("range", 16, directory=tmp_path)
    with capture(engine="range", lock=lock, integrity=None, lock_timeout=0.5) as captured:
        obs = captured.observer

        @obs.prefetch(block_ids="ids")
        def prefetch(ids):
            raise AssertionError("the call must not run")

        with pytest.raises(kvobs.TransferRejected, match="block id 16 is out of range for a cache of 16 blocks"):
            if entry == "decorator":
                prefetch([3, 16])
            elif entry == "with":
                with obs.transfer("prefetch", block_ids=[3, 16]):
                    raise AssertionError("the body must not run")
            else:
                obs.begin("prefetch", block_ids=[3, 16])
        assert captured.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="rejected") == 1
        assert captured.value(sc.TRANSFERS_TOTAL, path="prefetch", outcome="error") in (None, 0.0)
        assert lock.blocks_claimed() == {"shared": 0, "exclusive": 0}
        with obs.transfer("prefetch", block_ids=[15]):  # the last block is in range
            pass
    lock.close()


def test_a_capacity_larger_than_the_block_lock_is_refused(tmp_path, registry):
    lock = kvobs.BlockLock("small", 16, directory=tmp_path)
    with pytest.raises(ValueError, match="capacity=32 .* 16 blocks"):
        kvobs.KVObserver("big", registry=registry, lock=lock, capacity=32)
    lock.close()


# -- the tracing context is the caller's again after every transfer ------------------------------------------


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
    cache = torch.ones(8, 2, 4, dtype=torch.float16)
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


def test_an_async_call_kvobs_makes_no_span_for_detaches_nothing(registry, caplog):
    obs = kvobs.KVObserver("quiet", registry=registry, enabled=False, integrity=None)
    with caplog.at_level("ERROR", logger="opentelemetry.context"):
        _decorated_async(obs)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry")] == []


# -- re-entry: refused at once where a transfer would wait for its own caller, and only there ----------------


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


def test_reentry_is_refused_past_an_outer_transfer_that_claims_nothing():
    with capture(engine="guard", integrity=None, lock_timeout=5.0) as cap:
        obs = cap.observer
        with obs.transfer("send", block_ids=[]), obs.transfer("prefetch", block_ids=[1]), \
                pytest.raises(kvobs.ReentrantLockError):  # at once, not after the 5 s timeout
            obs.transfer("write_back", block_ids=[1]).start()


def test_transfers_on_disjoint_blocks_of_a_block_lock_nest(tmp_path):
    lock = BlockLock("nest", 8, directory=tmp_path)
    with capture(engine="nest", integrity=None, lock=lock, lock_timeout=5.0) as cap:
        obs = cap.observer
        with obs.transfer("prefetch", block_ids=[1]), obs.transfer("write_back", block_ids=[2]) as inner:
            assert inner.state == "held"  # other blocks: no wait on itself to refuse
        with obs.transfer("prefetch", block_ids=[1]), pytest.raises(kvobs.ReentrantLockError):
            obs.transfer("write_back", block_ids=[1, 2]).start()
    lock.close()


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


# -- what a transfer counts and says: moved blocks, its state, how long it waited ----------------------------


@pytest.mark.parametrize("form", ["sync", "async"])
def test_a_guard_naming_only_the_moved_blocks_counts_them(form):
    with capture(engine="guard", integrity=None) as cap:
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


def test_a_completion_naming_the_moved_blocks_counts_them_without_an_integrity_policy():
    with capture(engine="guard", integrity=None) as cap:
        cap.observer.begin("prefetch", block_ids=[1, 2, 3]).complete(moved=[2])
        assert cap.value(sc.TRANSFER_BLOCKS_TOTAL, path="prefetch") == 1


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


# -- what may be guarded: no generators, no awaitable handed back by a sync function -------------------------


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


# -- hooks ---------------------------------------------------------------------------------------------------


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
