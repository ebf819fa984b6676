"""The guarded call: order of operations, outcomes, metrics, spans and logs, with a real lock."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

import kvobs
from kvobs import semconv as sc
from kvobs.testing import capture
from support import lock_is_free, lock_is_free_from_other_thread


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
    assert log["event"] == "kvobs.transfer" and log["log_level"] == "debug"
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
