"""The fast lane (`kvobs._lifecycle.fast_lane`): a synchronous guarded call that names nothing in the call, on a
ThreadLock or NullLock, keeps every guarantee of the general lifecycle.

Real threads, real forks and real signals: the lane's safety rests on what the interpreter does between two
bytecodes, so nothing here is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import structlog
from interrupts import interrupt_storm
from opentelemetry import baggage
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import NoOpTracerProvider
from prometheus_client import CollectorRegistry
from support import REPO, hold_in_thread, lock_is_free, lock_is_free_from_other_thread

import kvobs
from kvobs import semconv as sc
from kvobs.errors import ReentrantLockError
from kvobs.locks import _async_wait as async_wait
from kvobs.locks._cache_lock import ProcessLock

REGISTRIES: dict[int, CollectorRegistry] = {}


def observer(lock=None, **options) -> kvobs.KVObserver:
    """Metrics only: an explicit no-op tracer provider, whatever another test set globally."""
    options.setdefault("tracer_provider", NoOpTracerProvider())
    options.setdefault("lock_timeout", 2.0)
    registry = options.setdefault("registry", CollectorRegistry())
    obs = kvobs.KVObserver("lane", lock=lock or kvobs.ThreadLock(), integrity=None, **options)
    REGISTRIES[id(obs)] = registry
    return obs


def value(obs: kvobs.KVObserver, name: str, **labels) -> float:
    return REGISTRIES[id(obs)].get_sample_value(name, {"engine": "lane", **labels}) or 0.0


def lane_slot(obs: kvobs.KVObserver, path: str):
    """The calling thread's slot on the lane of `path`'s route, or None when no call here took the lane."""
    return getattr(obs._routes[path].lane.local, "slot", None)


def test_a_guard_naming_nothing_takes_the_lane_and_counts_like_the_general_path(tmp_path):
    fast = observer()
    general = observer(lock=ProcessLock("lane-general", directory=tmp_path))
    assert general._routes["send"].lane is None  # a two-step acquire (mutex, then flock): no lane

    for obs in (fast, general):
        @obs.send()
        def send(x):
            return x * 2

        assert [send(i) for i in range(5)] == [0, 2, 4, 6, 8]
        assert value(obs, sc.TRANSFERS_TOTAL, path="send", outcome="ok") == 5
        assert value(obs, sc.TRANSFER_DURATION_SECONDS + "_count", path="send", outcome="ok") == 5
        lock_name = obs.lock.name
        assert value(obs, sc.LOCK_WAIT_SECONDS + "_count", lock=lock_name, path="send") == 5
        assert value(obs, sc.LOCK_HOLD_SECONDS + "_count", lock=lock_name, path="send") == 5
        assert value(obs, sc.TRANSFER_BLOCKS_TOTAL, path="send") == 0
        assert lock_is_free(obs.lock) and obs.open.count("send") == 0
    assert lane_slot(fast, "send") is not None


def test_a_guard_naming_kv_groups_or_reading_its_result_stays_on_the_general_path():
    obs = observer()

    @obs.send(block_ids="ids", group_sizes="groups")
    def send(ids, groups):
        return ids

    @obs.prefetch(result=list)
    def load():
        return [1]

    send([1, 2], [2])
    load()
    assert lane_slot(obs, "send") is None and lane_slot(obs, "prefetch") is None
    assert value(obs, sc.TRANSFER_BLOCKS_TOTAL, path="send") == 2


def test_block_ids_bytes_and_request_id_on_the_lane_count_and_reach_hooks_like_the_general_path(tmp_path):
    counts = {}
    for kind, lock in (("lane", kvobs.ThreadLock()), ("general", ProcessLock("lane-ids", directory=tmp_path))):
        records = []
        obs = observer(lock=lock, block_bytes=4096, hooks=[records.append])

        @obs.write_back(block_ids="ids", keys="keys", sync="is_sync", request_id="rid")
        def write(ids, rid, keys=("a", "b", "c"), is_sync=True):
            return len(ids)

        @obs.send(block_ids="ids", nbytes="size")
        def send(ids, size):
            return size

        assert write([3, 1, 2], "req-7") == 3 and send((5, 6), 100) == 100
        counts[kind] = (value(obs, sc.TRANSFER_BLOCKS_TOTAL, path="write_back"),
                        value(obs, sc.TRANSFER_BYTES_TOTAL, path="write_back"),
                        value(obs, sc.TRANSFER_BYTES_TOTAL, path="send"),
                        [(r.path, r.blocks, r.bytes, r.request_id) for r in records])
        lane = obs._routes["write_back"].lane
        assert (lane is not None and getattr(lane.local, "slot", None) is not None) is (kind == "lane")
    assert counts["lane"] == counts["general"] == (
        3, 3 * 4096, 100, [("write_back", 3, 3 * 4096, "req-7"), ("send", 2, 100, None)])


def test_a_guard_naming_no_blocks_but_a_size_and_a_request_takes_the_lane_and_claims_the_whole_cache():
    obs = observer()
    holding = []

    @obs.send(nbytes="size", request_id="rid")
    def send(size, rid):
        holding.append(lock_is_free_from_other_thread(obs.lock))
        return size

    assert send(64, "req-3") == 64
    assert holding == [False]  # the whole cache is claimed
    assert lane_slot(obs, "send").route is obs._routes["send"]
    assert value(obs, sc.TRANSFER_BYTES_TOTAL, path="send") == 64


@pytest.mark.parametrize("ids, size, keys, is_sync", [
    ([1, 1], None, None, True), ([-1], None, None, True), ([1], -5, None, True), ("bad", None, None, True),
    ([1, 2, 3], None, ["k"], True), ([1], None, "k", True), ([1], None, None, False), ([1], None, None, 1)])
def test_a_value_that_does_not_validate_is_rejected_by_the_general_path_with_nothing_held(ids, size, keys, is_sync):
    obs = observer()

    @obs.prefetch(block_ids="ids", nbytes="size", keys="keys", sync="is_sync")
    def load(ids, size, keys, is_sync):
        raise AssertionError("never runs")

    with pytest.raises(kvobs.TransferRejected):
        load(ids, size, keys, is_sync)
    assert value(obs, sc.TRANSFERS_TOTAL, path="prefetch", outcome="rejected") == 1
    assert lock_is_free(obs.lock) and not lane_slot(obs, "prefetch").pending


def test_an_empty_list_of_blocks_claims_nothing_as_on_the_general_path():
    obs = observer()
    inside = []

    @obs.send(block_ids="ids")
    def send(ids):
        inside.append(lock_is_free_from_other_thread(obs.lock))

    send([])
    assert inside == [True]  # nothing claimed, nothing to protect
    assert value(obs, sc.TRANSFERS_TOTAL, path="send", outcome="ok") == 1


def test_an_error_passes_through_unchanged_and_is_recorded():
    obs = observer()
    cause = ValueError("cause")

    @obs.write_back()
    def write():
        raise RuntimeError("boom") from cause

    with pytest.raises(RuntimeError) as info:
        write()
    assert info.value.__cause__ is cause
    assert value(obs, sc.TRANSFERS_TOTAL, path="write_back", outcome="error") == 1
    assert lock_is_free(obs.lock) and obs.open.count("write_back") == 0


class BareAwaitable:
    """An awaitable with nothing to close (no `close` method, unlike a coroutine)."""

    def __await__(self):
        yield from ()


@pytest.mark.parametrize("awaitable", ["coroutine", "bare"])
def test_a_sync_call_returning_an_awaitable_is_refused_on_the_lane_too(awaitable):
    obs = observer()

    async def copy():
        return "copied"

    @obs.send(block_ids="ids")
    def submit(ids):
        return copy() if awaitable == "coroutine" else BareAwaitable()

    with pytest.raises(TypeError, match="returned an awaitable"):
        submit([1])
    assert value(obs, sc.TRANSFERS_TOTAL, path="send", outcome="error") == 1
    assert lock_is_free(obs.lock) and lane_slot(obs, "send") is not None


def test_a_busy_lock_sends_the_call_to_the_general_path_which_waits_counts_and_times_out():
    obs = observer(lock_timeout=0.2)

    @obs.send()
    def send():
        return "sent"

    release, thread = hold_in_thread(obs.lock._lock)
    try:
        with pytest.raises(kvobs.LockTimeout):
            send()
    finally:
        release.set()
        thread.join()
    assert value(obs, sc.TRANSFERS_TOTAL, path="send", outcome="timeout") == 1
    assert send() == "sent"
    assert lock_is_free(obs.lock)


def test_a_conflict_names_the_fast_lane_holder_and_held_for_counts_its_hold():
    obs = observer()
    inside, leave = threading.Event(), threading.Event()

    @obs.prefetch()
    def load():
        inside.set()
        leave.wait(10)

    @obs.send()
    def send():
        return "sent"

    thread = threading.Thread(target=load)
    thread.start()
    assert inside.wait(10)
    time.sleep(0.02)
    assert obs.lock.held_for() >= 0.02
    assert obs.open.count("prefetch") == 1 and obs.open.oldest_age("prefetch") >= 0.02
    assert value(obs, sc.TRANSFERS_IN_FLIGHT, path="prefetch") == 1  # the scraped gauge agrees
    waiter = threading.Thread(target=send)
    waiter.start()
    time.sleep(0.05)
    leave.set()
    thread.join()
    waiter.join()
    assert value(obs, sc.LOCK_CONFLICTS_TOTAL, lock=obs.lock.name, path="send", holder_path="prefetch") == 1
    assert obs.lock.held_for() == 0.0 and obs.open.count("prefetch") == 0


@pytest.mark.parametrize("inner", ["fast", "general", "with"])
def test_a_guarded_call_under_a_fast_lane_call_on_the_same_lock_is_refused_at_once(inner):
    obs = observer(lock_timeout=5.0)

    @obs.write_back()
    def fast_inner():
        return None

    @obs.write_back(block_ids="ids")
    def general_inner(ids):
        return None

    def with_inner():
        with obs.transfer("write_back", block_ids=[3]):
            pass

    nested = {"fast": fast_inner, "general": lambda: general_inner([1]), "with": with_inner}[inner]

    @obs.prefetch()
    def outer():
        started = time.monotonic()
        with pytest.raises(ReentrantLockError, match="prefetch"):
            nested()
        return time.monotonic() - started

    assert outer() < 1.0  # refused, not timed out
    assert lock_is_free(obs.lock)
    assert value(obs, sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 1


def test_a_fast_lane_call_under_a_with_block_is_refused_too():
    obs = observer(lock_timeout=5.0)

    @obs.send()
    def send():
        return None

    with obs.transfer("write_back", block_ids=[1]):
        with pytest.raises(ReentrantLockError):
            send()
    assert lock_is_free(obs.lock)


def test_another_lock_under_a_fast_lane_call_is_no_reentry():
    obs, other = observer(), observer()

    @other.send()
    def inner():
        return "inner"

    @obs.send()
    def outer():
        return inner()

    assert outer() == "inner"
    assert lock_is_free(obs.lock) and lock_is_free(other.lock)


@pytest.mark.parametrize("late", ["returns", "raises"])
def test_a_hung_call_is_abandoned_at_its_deadline_and_its_late_end_changes_nothing(late):
    records = []
    obs = observer(deadline=0.2, hooks=[records.append])
    leave = threading.Event()

    @obs.prefetch()
    def load():
        leave.wait(10)
        if late == "raises":
            raise OSError("late failure")
        return "late"

    results = []

    def run():
        try:
            results.append(load())
        except OSError as exc:
            results.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 5
    while not records and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r.outcome for r in records] == [sc.OUTCOME_ABANDONED]
    assert lock_is_free_from_other_thread(obs.lock)
    assert obs.open.count("prefetch") == 0
    leave.set()
    thread.join()
    assert results == ["late"] if late == "returns" else isinstance(results[0], OSError)
    assert len(records) == 1


def test_a_call_within_its_deadline_is_never_abandoned_however_long_it_holds():
    """Held past several rounds of the deadline thread (a quarter of the deadline apart), not past the
    deadline itself."""
    records = []
    obs = observer(deadline=0.6, hooks=[records.append])

    @obs.send()
    def send():
        time.sleep(0.35)
        return "sent"

    assert send() == "sent"
    assert [r.outcome for r in records] == ["ok"]


def test_the_deadline_thread_never_takes_a_later_calls_release():
    """The key a call arms under, not the slot, is what the deadline thread takes: a stale view of an
    expired call finds nothing once that call ended, even though the slot holds again."""
    obs = observer(deadline=60)
    inside, leave = threading.Event(), threading.Event()

    @obs.send()
    def send():
        inside.set()
        leave.wait(10)

    thread = threading.Thread(target=send)
    thread.start()
    assert inside.wait(10)
    lane = obs._routes["send"].lane
    (slot,) = [s for s in lane.slots if s.holds()]
    stale = lane.expired(now=time.perf_counter() + 120)
    leave.set()
    thread.join()
    inside.clear()
    leave.clear()
    thread = threading.Thread(target=send)  # another call: another thread's slot, or a later key
    thread.start()
    assert inside.wait(10)
    for call in stale:
        call.abandon()
    assert not lock_is_free_from_other_thread(obs.lock)  # the later call still holds
    leave.set()
    thread.join()
    assert value(obs, sc.TRANSFERS_TOTAL, path="send", outcome="ok") == 2
    assert value(obs, sc.TRANSFERS_TOTAL, path="send", outcome="abandoned") == 0
    assert slot.pending == {}


@pytest.mark.parametrize("hooked", [True, False])
def test_calls_of_several_guards_on_one_thread_each_record_their_own_values(hooked):
    """A thread's fast-path calls on one lock share a slot, which reuses its transfers: each call is still
    recorded with its own path, blocks, bytes, request and error, whichever guard ran before it."""
    records = []
    obs = observer(block_bytes=4096, hooks=[records.append] if hooked else [])

    @obs.write_back()
    def write():
        return "written"

    @obs.send()
    def send():
        return "sent"

    @obs.prefetch(block_ids="ids", request_id="rid")
    def load(ids, rid):
        return ids

    @obs.send()
    def fail():
        raise OSError("link down")

    @obs.write_back(block_ids="ids", nbytes="size", request_id="rid")
    def write_sized(ids, size=None, rid=None):
        return size

    for _ in range(2):
        assert write() == "written" and send() == "sent" and load([4, 5], "req-1") == [4, 5]
        with pytest.raises(OSError):
            fail()
        assert send() == "sent" and write() == "written"
        assert write_sized([1], 100, "req-2") == 100 and write_sized([2, 3]) is None  # its last call's values, gone
    assert value(obs, sc.TRANSFERS_TOTAL, path="write_back", outcome="ok") == 8
    assert value(obs, sc.TRANSFER_BLOCKS_TOTAL, path="write_back") == 6
    assert value(obs, sc.TRANSFER_BYTES_TOTAL, path="write_back") == 2 * (100 + 2 * 4096)
    assert value(obs, sc.TRANSFERS_TOTAL, path="send", outcome="ok") == 4
    assert value(obs, sc.TRANSFERS_TOTAL, path="send", outcome="error") == 2
    assert value(obs, sc.TRANSFERS_TOTAL, path="prefetch", outcome="ok") == 2
    assert value(obs, sc.TRANSFER_BLOCKS_TOTAL, path="prefetch") == 4
    assert value(obs, sc.TRANSFER_BYTES_TOTAL, path="prefetch") == 4 * 4096
    assert value(obs, sc.TRANSFER_BLOCKS_TOTAL, path="send") == 0
    if hooked:
        assert [(r.path, r.outcome, r.blocks, r.bytes, r.request_id, type(r.error).__name__) for r in records] == [
            ("write_back", "ok", 0, 0, None, "NoneType"), ("send", "ok", 0, 0, None, "NoneType"),
            ("prefetch", "ok", 2, 2 * 4096, "req-1", "NoneType"), ("send", "error", 0, 0, None, "OSError"),
            ("send", "ok", 0, 0, None, "NoneType"), ("write_back", "ok", 0, 0, None, "NoneType"),
            ("write_back", "ok", 1, 100, "req-2", "NoneType"), ("write_back", "ok", 2, 2 * 4096, None, "NoneType")] * 2
    assert lock_is_free(obs.lock)


def test_a_hook_making_a_guarded_call_on_the_same_lock_is_recorded_apart():
    """A hook runs on the calling thread once the lock is released, before the call has finished: a guarded
    call it makes there takes the fast path too, with a transfer of its own."""
    records = []

    def hook(record):
        records.append(record)
        if record.path == "write_back":
            assert send() == "sent"

    obs = observer(hooks=[hook])

    @obs.send()
    def send():
        return "sent"

    @obs.write_back()
    def write():
        return "written"

    assert write() == "written" and write() == "written"
    assert [(r.path, r.outcome) for r in records] == [("write_back", "ok"), ("send", "ok")] * 2
    assert value(obs, sc.TRANSFERS_TOTAL, path="send", outcome="ok") == 2
    assert lock_is_free(obs.lock) and not lane_slot(obs, "send").pending


def test_an_abandoned_calls_transfer_stays_the_deadline_threads():
    """The slot reuses the transfer of a call its thread ended; the transfer of an abandoned call is the deadline
    thread's, which records it, so the thread's next call takes another."""
    records = []
    obs = observer(deadline=0.2, hooks=[records.append])
    leave = threading.Event()
    seen = []

    @obs.send()
    def send(hang):
        seen.append(lane_slot(obs, "send").t)
        if hang:
            leave.wait(10)
        return "sent"

    def run():
        assert send(False) == "sent" and send(True) == "sent" and send(False) == "sent"

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 5
    while len(records) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    leave.set()
    thread.join()
    assert [r.outcome for r in records] == ["ok", sc.OUTCOME_ABANDONED, "ok"]
    assert records[1].duration_s >= 0.2 > records[2].duration_s
    assert seen[1] is seen[0]  # reused: ended by its own thread
    assert seen[2] is not seen[1]


@pytest.mark.parametrize("lock_kind", ["thread", "null"])
@pytest.mark.parametrize("enabled", [True, False])
def test_interrupt_storm_on_the_fast_lane_leaks_nothing(lock_kind, enabled):
    lock = kvobs.ThreadLock() if lock_kind == "thread" else kvobs.NullLock()
    obs = observer(lock=lock, enabled=enabled)

    @obs.send()
    def send():
        return None

    class Calls:
        def __call__(self):
            send()

        def lock_is_free(self):
            return lock_is_free(lock) and obs.open.count("send") == 0 and not lane_slot(obs, "send").pending

        def recover(self):
            pass

    send()  # the slot exists before the storm
    calls, interrupted, leaked = interrupt_storm(Calls())
    assert interrupted > 500, (calls, interrupted)
    assert leaked == 0, f"{leaked} of {interrupted} interrupted calls left something held"


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def test_a_traced_call_on_the_lane_records_its_span_current_while_the_call_runs(spans):
    provider, exporter = spans
    obs = observer(tracer_provider=provider)
    engine_tracer = provider.get_tracer("engine")

    @obs.send()
    def send():
        with engine_tracer.start_as_current_span("engine.copy"):
            return "sent"

    assert send() == "sent"
    copy, transfer = exporter.get_finished_spans()
    assert (copy.name, transfer.name) == ("engine.copy", "kvobs.send")
    assert copy.parent.span_id == transfer.context.span_id
    assert transfer.attributes[sc.ATTR_OUTCOME] == "ok" and transfer.attributes[sc.ATTR_LOCK_WAIT_S] == 0.0
    assert transfer.attributes[sc.ATTR_LOCK_HOLD_S] > 0
    assert transfer.attributes[sc.ATTR_BYTES] == 0
    assert sc.ATTR_BLOCK_IDS not in transfer.attributes  # it named none
    assert lane_slot(obs, "send").route is obs._routes["send"]
    exemplar = REGISTRIES[id(obs)].collect()
    assert any(s.exemplar and s.exemplar.labels["trace_id"] == format(transfer.context.trace_id, "032x")
               for m in exemplar for s in m.samples)


def test_a_traced_call_on_the_lane_nests_in_the_callers_context_and_keeps_it(spans):
    """The lane reads the current context once, for the span's parent and for the context the call runs in:
    the caller's span is the parent, the engine's span the child, the caller's baggage stays visible, and the
    caller's context is current again afterwards."""
    provider, exporter = spans
    obs = observer(tracer_provider=provider)
    app_tracer = provider.get_tracer("app")
    seen = []

    @obs.send()
    def send():
        with app_tracer.start_as_current_span("engine.copy"):
            seen.append(baggage.get_baggage("tenant"))

    token = otel_context.attach(baggage.set_baggage("tenant", "t1"))
    try:
        with app_tracer.start_as_current_span("request") as outer:
            send()
            assert otel_trace.get_current_span() is outer
    finally:
        otel_context.detach(token)
    copy, transfer, request = exporter.get_finished_spans()
    assert (copy.name, transfer.name, request.name) == ("engine.copy", "kvobs.send", "request")
    assert transfer.parent.span_id == request.context.span_id
    assert copy.parent.span_id == transfer.context.span_id
    assert seen == ["t1"]


def test_a_sampled_off_call_on_the_lane_is_still_the_engine_spans_parent():
    """Sampled off, kvobs's span records nothing, yet it is current during the call: the engine's span
    follows the parent-based sampler's decision and is not recorded either, in the same trace."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    obs = observer(tracer_provider=provider)
    inner = []

    @obs.send()
    def send():
        with provider.get_tracer("engine").start_as_current_span("engine.copy") as copy:
            inner.append((copy.is_recording(), copy.get_span_context().trace_id))
        return otel_trace.get_current_span().get_span_context().trace_id

    trace_id = send()
    assert inner == [(False, trace_id)] and trace_id != 0
    assert exporter.get_finished_spans() == ()
    provider.shutdown()


def test_a_traced_call_naming_blocks_on_the_lane_puts_them_on_its_span(spans):
    provider, exporter = spans
    obs = observer(tracer_provider=provider, block_bytes=4096)

    @obs.prefetch(block_ids="ids", keys="keys", request_id="rid")
    def load(ids, keys, rid):
        return ids

    load([7, 3], ["k7", "k3"], "req-1")
    (span,) = exporter.get_finished_spans()
    assert list(span.attributes[sc.ATTR_BLOCK_IDS]) == [7, 3] and span.attributes[sc.ATTR_BLOCKS] == 2
    assert list(span.attributes[sc.ATTR_KEYS]) == ["k7", "k3"]
    assert span.attributes[sc.ATTR_REQUEST_ID] == "req-1"
    assert span.attributes[sc.ATTR_BYTES] == 2 * 4096 and span.attributes[sc.ATTR_OUTCOME] == "ok"
    assert lane_slot(obs, "prefetch").route is obs._routes["prefetch"]


def test_a_traced_call_that_raises_or_hangs_ends_its_span_as_an_error(spans):
    provider, exporter = spans
    obs = observer(tracer_provider=provider, deadline=0.2)
    leave = threading.Event()

    @obs.send()
    def send(hang):
        if hang:
            leave.wait(10)
            return "late"
        raise KeyError("gone")

    with pytest.raises(KeyError):
        send(False)
    thread = threading.Thread(target=send, args=(True,))
    thread.start()
    deadline = time.monotonic() + 5
    while len(exporter.get_finished_spans()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    leave.set()
    thread.join()
    failed, abandoned = exporter.get_finished_spans()
    assert failed.attributes[sc.ATTR_ERROR_TYPE] == "KeyError"
    assert abandoned.attributes[sc.ATTR_ERROR_TYPE] == sc.OUTCOME_ABANDONED
    assert len(exporter.get_finished_spans()) == 2  # the late return ends nothing twice


def test_a_global_provider_set_later_is_picked_up_by_the_lane():
    """In a process of its own: the global provider can be set once per process."""
    script = """
import kvobs
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
obs = kvobs.KVObserver("lane", registry=CollectorRegistry(), integrity=None)
@obs.send()
def send():
    return None
send()
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
obs._routes["send"].recorder.tracer_source.recheck_at = 0.0  # as if RECHECK_S had passed
send()
print(len(exporter.get_finished_spans()))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == "1", out.stderr


def test_hooks_and_debug_logs_see_fast_lane_calls_as_any_other():
    records, logs = [], structlog.testing.LogCapture()
    obs = observer(hooks=[records.append], log_level="debug",
                   logger=structlog.wrap_logger(structlog.PrintLogger(), processors=[logs]))

    @obs.write_back()
    def write():
        return None

    write()
    (record,) = records
    assert (record.path, record.outcome, record.blocks, record.bytes, record.error) == (
        "write_back", "ok", 0, 0, None)
    assert record.lock_wait_s == 0.0 and record.lock_hold_s == record.duration_s > 0
    assert [e["event"] for e in logs.entries] == ["kvobs._lifecycle.transfer"]
    assert lane_slot(obs, "write_back") is not None


def test_a_failing_metric_never_changes_the_call_and_is_counted(caplog):
    obs = observer()

    @obs.send()
    def send():
        return "sent"

    def broken(*args, **kwargs):
        raise RuntimeError("metrics down")

    obs._routes["send"].recorder.metrics.finished = broken
    with caplog.at_level(logging.ERROR):
        assert send() == "sent"
    assert value(obs, sc.TELEMETRY_ERRORS_TOTAL, stage="metrics") == 1
    assert lock_is_free(obs.lock)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_takes_its_own_lane_even_when_a_parent_thread_held_the_lock():
    obs = observer()
    inside, leave = threading.Event(), threading.Event()

    @obs.send()
    def send():
        if threading.current_thread() is not threading.main_thread():
            inside.set()
            leave.wait(10)
        return "sent"

    send()  # the main thread has a slot, built on the parent's mutex
    thread = threading.Thread(target=send)
    thread.start()
    assert inside.wait(10)
    pid = os.fork()
    if pid == 0:
        try:
            ok = send() == "sent" and lock_is_free(obs.lock) and obs.open.count("send") == 0
        except BaseException:  # noqa: BLE001
            ok = False
        os._exit(0 if ok else 1)
    leave.set()
    thread.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("ending", ["returns", "raises", "abandoned"])
def test_a_release_on_the_fast_lane_wakes_a_coroutine_waiting_for_the_lock(monkeypatch, ending):
    monkeypatch.setattr(async_wait, "_FIRST_SLEEP_S", 5.0)  # only a wake-up can be quicker than this
    monkeypatch.setattr(async_wait, "_MAX_SLEEP_S", 5.0)
    obs = observer(lock_timeout=10.0, deadline=0.3 if ending == "abandoned" else 60)
    inside, leave = threading.Event(), threading.Event()

    @obs.send()
    def send():
        inside.set()
        leave.wait(10)
        if ending == "raises":
            raise OSError("send failed")

    def run():
        with contextlib.suppress(OSError):
            send()

    started = time.monotonic()
    thread = threading.Thread(target=run)
    thread.start()
    assert inside.wait(10)

    async def wait_for_lock():
        async with obs.transfer("write_back", block_ids=[1]):
            return time.monotonic()

    async def main():
        waiter = asyncio.ensure_future(wait_for_lock())
        await asyncio.sleep(0.05)
        if ending != "abandoned":
            released = time.monotonic()
            leave.set()
        else:  # the deadline thread releases it, at about `deadline` after the call began
            released = started + 0.3
        return await waiter, released

    acquired, released = asyncio.run(main())
    leave.set()
    thread.join()
    assert acquired - released < 2.0
    assert lock_is_free(obs.lock)
