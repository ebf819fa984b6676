"""The lifecycle under stress: the deadline thread survives and is supervised; no interrupt leaks a lock,
whether a storm of real signals lands on guarded calls and with-blocks or an interrupt lands at any instruction
of an exit; a with-block exited in another thread or context releases; `block_ids=None` is refused as the
decorators refuse it; floods of rejected or abandoned transfers log a bounded number of lines with exact
counts.

Real threads and real signals throughout (the storm is a SIGALRM interval timer whose handler raises).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import sys
import threading
import time
from typing import Any

import pytest
import structlog
from interrupts import Interrupt, interrupt_at, interrupt_storm
from support import lock_is_free, lock_is_free_from_other_thread

import kvobs
from kvobs import semconv as sc
from kvobs._lifecycle.open_transfers import _REAPER, EVENT_RESTARTED
from kvobs.errors import LockTimeout, TransferRejected
from kvobs.locks._block_lock import BlockLock
from kvobs.locks._cache_lock import ProcessLock
from kvobs.telemetry import _recorder as recorder_module
from kvobs.telemetry._failures import STAGE_DEADLINE_THREAD
from kvobs.telemetry._ratelimit import SUPPRESSED_FIELD
from kvobs.testing import capture

# An interrupt that lands outside the transfer (in another library's gc callback) tests nothing and is only
# reported as unraisable: fail instead of warning.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")

# --- block_ids=None is refused, omitting it claims the whole cache -------------------------------------------


@pytest.mark.parametrize("entry", ["begin", "transfer"])
@pytest.mark.parametrize("value", ["block_ids", "requests"])
def test_explicit_none_for_the_blocks_is_rejected_like_the_decorators_do(cap, entry, value):
    obs = cap.observer

    @obs.send(block_ids="ids")
    def send(ids):
        return ids

    with pytest.raises(TransferRejected, match="None"):
        send(None)
    with pytest.raises(TransferRejected, match="None"):
        if entry == "begin":
            obs.begin("send", **{value: None})
        else:
            with obs.transfer("send", **{value: None}):
                pass
    assert lock_is_free(obs.lock)
    assert cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="rejected") == 2
    assert not cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="ok")


def test_omitting_the_blocks_still_claims_the_whole_cache(tmp_path):
    lock = BlockLock("whole", 16, directory=tmp_path)
    obs = kvobs.KVObserver("whole", lock=lock, integrity=None, lock_timeout=0.05, enabled=False)
    whole = obs.begin("send")
    with pytest.raises(LockTimeout):
        obs.begin("prefetch", block_ids=[7])
    whole.complete()
    obs.begin("prefetch", block_ids=[7]).complete()
    with obs.transfer("send"):  # the same from another thread (here it would be a re-entry)
        errors = []
        waiter = threading.Thread(target=_begin_recording_error, args=(obs, errors))
        waiter.start()
        waiter.join()
        assert [type(e) for e in errors] == [LockTimeout]
    lock.close()


def _begin_recording_error(obs: kvobs.KVObserver, errors: list[BaseException]) -> None:
    try:
        obs.begin("prefetch", block_ids=[15]).complete()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        errors.append(exc)


# --- the deadline thread survives and is supervised ----------------------------------------------------------


def _abandoned_within(obs: kvobs.KVObserver, seconds: float) -> bool:
    """Begin a transfer and leave it open: the deadline thread must abandon it (and free its lock)."""
    t = obs.begin("send", block_ids=[1])
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if t.state == "abandoned":
            return obs.lock is None or lock_is_free(obs.lock)
        time.sleep(0.005)
    return False


def _new_observers(count: int, kept: list[kvobs.KVObserver]) -> None:
    for i in range(count):
        kept.append(kvobs.KVObserver(f"grow-{i}", enabled=False, integrity=None))


def test_observers_created_in_threads_while_transfers_are_open_do_not_kill_the_deadline_thread(cap):
    """The deadline thread read the set of tables while other threads added to it: `Set changed size during
    iteration` ended the thread for good, and no transfer was ever abandoned again."""
    obs = kvobs.KVObserver("reaped", lock=None, enabled=False, integrity=None, deadline=0.05)
    kept: list[kvobs.KVObserver] = []
    previous = sys.getswitchinterval()
    sys.setswitchinterval(2e-5)
    try:
        open_transfers = [obs.begin("prefetch", block_ids=[i]) for i in range(8)]  # noqa: F841 - left open
        growers = [threading.Thread(target=_new_observers, args=(300, kept)) for _ in range(4)]
        for grower in growers:
            grower.start()
        for grower in growers:
            grower.join()
    finally:
        sys.setswitchinterval(previous)
    assert _abandoned_within(obs, 5.0), "the deadline thread no longer abandons transfers"


class _BrokenLane:
    """A fast lane whose bookkeeping raises: whatever goes wrong in one round must not end the thread."""

    def __init__(self) -> None:
        self.calls = 0

    def open_calls(self, table, path):
        return ()

    def expired(self, now):
        self.calls += 1
        raise KeyError("broken lane")


def test_the_deadline_thread_survives_any_exception_counts_each_restart_and_logs_it_once(cap):
    reaped = kvobs.KVObserver("reaped", registry=cap.registry, integrity=None, deadline=0.02, lock_timeout=0.5)
    lane = _BrokenLane()
    before = _REAPER.restarts
    with structlog.testing.capture_logs() as logs:
        reaped.open.watch_lane(lane)
        deadline = time.monotonic() + 5
        while lane.calls < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        reaped.open.lanes.remove(lane)
    assert lane.calls >= 3, "the deadline thread stopped after the first failure"
    assert _abandoned_within(reaped, 5.0)
    restarts = _REAPER.restarts - before
    assert restarts >= 3
    assert cap.value(sc.TELEMETRY_ERRORS_TOTAL, engine="reaped", stage=STAGE_DEADLINE_THREAD) == restarts
    lines = [line for line in logs if line["event"] == EVENT_RESTARTED]
    assert len(lines) == 1 and lines[0]["error_type"] == "KeyError", lines


def test_an_asynchronous_exception_in_the_deadline_thread_is_survived(cap):
    """SystemExit injected into the thread (PyThreadState_SetAsyncExc, as a debugger or a watchdog would):
    the thread goes on and counts the restart."""
    reaped = kvobs.KVObserver("reaped", registry=cap.registry, integrity=None, deadline=0.02, lock_timeout=0.5)
    thread = _REAPER._thread
    assert thread is not None and thread.is_alive()
    before = _REAPER.restarts
    set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)
    assert set_async_exc(thread.ident, SystemExit) == 1
    deadline = time.monotonic() + 5
    while _REAPER.restarts == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _REAPER.restarts == before + 1
    assert thread.is_alive() and _REAPER._thread is thread
    assert _abandoned_within(reaped, 5.0)
    assert cap.value(sc.TELEMETRY_ERRORS_TOTAL, engine="reaped", stage=STAGE_DEADLINE_THREAD) == 1


# --- floods of refused and abandoned transfers: few log lines, exact counts ------------------------------------


def _lines(cap, event: str, outcome: str | None = None) -> list[dict]:
    return [line for line in cap.logs if line["event"] == event and line.get("outcome") == outcome]


def _told(lines: list[dict]) -> int:
    """How many events the lines account for: each line, plus the ones it says were left out before it."""
    return len(lines) + sum(line.get(SUPPRESSED_FIELD, 0) for line in lines)


@pytest.fixture
def short_log_interval(monkeypatch):
    monkeypatch.setattr(recorder_module, "LOG_INTERVAL_S", 0.2)


def test_a_flood_of_rejected_calls_logs_a_line_per_interval_with_exact_counts(short_log_interval):
    with capture(engine="flood", integrity=None, log_level="warning") as cap:
        @cap.observer.send(block_ids="ids")
        def send(ids):
            return ids

        calls = 20_000
        for _ in range(calls):
            with pytest.raises(TransferRejected):
                send([-1])
        time.sleep(0.25)
        with pytest.raises(TransferRejected):
            send(None)  # the line after the flood tells how many were left out since the last one
        lines = _lines(cap, "kvobs._lifecycle.transfer.rejected")
        assert cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="rejected") == calls + 1
        assert len(lines) < 200, f"{len(lines)} lines for {calls} rejected calls"
        assert _told(lines) == calls + 1


def test_abandoning_a_flood_of_transfers_logs_a_line_per_interval_with_exact_counts(short_log_interval):
    with capture(engine="flood", integrity=None, lock=None, deadline=0.05, log_level="warning") as cap:
        obs = cap.observer
        transfers = 5_000
        for i in range(transfers):
            obs.begin("send", block_ids=[i % 64])
        end = time.monotonic() + 20
        while cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="abandoned") != transfers:
            assert time.monotonic() < end, "the deadline thread did not abandon them all"
            time.sleep(0.01)
        time.sleep(0.25)
        obs.begin("send", block_ids=[1])
        while cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="abandoned") != transfers + 1:
            assert time.monotonic() < end
            time.sleep(0.01)
        lines = _lines(cap, "kvobs._lifecycle.transfer", sc.OUTCOME_ABANDONED)
        assert len(lines) < 100, f"{len(lines)} lines for {transfers} abandoned transfers"
        assert _told(lines) == transfers + 1


# --- a with-block's exit is as interrupt-safe as a decorated call ----------------------------------------------


def _storm_lock(kind: str, directory) -> Any:
    if kind == "thread":
        return kvobs.ThreadLock()
    if kind == "process":
        return ProcessLock("storm", directory=directory)
    return BlockLock("storm", 64, directory=directory)


class _WithBlocks:
    """`with obs.transfer(...): pass`, the body empty so that the storm lands on the entry and the exit."""

    def __init__(self, obs: kvobs.KVObserver) -> None:
        self.obs = obs

    def __call__(self) -> None:
        with self.obs.transfer("send", block_ids=[1, 2]):
            pass

    def lock_is_free(self) -> bool:
        lock = self.obs.lock
        if self.obs.open.count("send"):
            return False
        if isinstance(lock, BlockLock):
            return lock.blocks_claimed() == {"shared": 0, "exclusive": 0}
        return lock_is_free(lock)

    def recover(self) -> None:
        for table in self.obs.open.by_path.values():
            for t in list(table.values()):
                t.abandon()


@pytest.mark.parametrize("kind", ["thread", "process", "block"])
def test_interrupt_storm_on_with_blocks_leaks_no_lock(tmp_path, kind):
    lock = _storm_lock(kind, tmp_path)
    obs = kvobs.KVObserver("storm", lock=lock, enabled=False, integrity=None, lock_timeout=1.0)
    calls = _WithBlocks(obs)
    rounds, interrupted, leaked = interrupt_storm(calls, seconds=2.0, interrupted_calls=300, spread=60)
    assert interrupted >= 300, (rounds, interrupted)
    assert leaked == 0, f"{leaked} of {interrupted} interrupted with-blocks left the lock held ({rounds} rounds)"
    assert calls.lock_is_free()
    calls()  # and the next with-block is neither a re-entry nor kept waiting


@pytest.mark.parametrize("body", ["clean", "raising"])
def test_an_interrupt_at_any_instruction_of_the_exit_leaks_nothing(tmp_path, body):
    """For n = 1, 2, ...: interrupt the with-block's exit before its n-th instruction (n = 1: before anything
    in `__exit__` runs), until an exit runs to its end. No lock, open transfer or active entry is left."""
    lock = BlockLock("exit", 8, directory=tmp_path)
    obs = kvobs.KVObserver("exit", lock=lock, integrity=None, lock_timeout=0.5, enabled=False)
    calls = _WithBlocks(obs)
    finished = False
    for opcode in range(1, 10_000):
        try:
            with obs.transfer("send", block_ids=[1, 2]):
                sys.settrace(interrupt_at(opcode, __file__))
                if body == "raising":
                    raise KeyError("the body failed")
            finished = True
        except KeyError:
            finished = True  # the body's own exception came out: the exit ran to its end
        except Interrupt:
            pass
        finally:
            sys.settrace(None)
        assert calls.lock_is_free(), f"interrupted before instruction {opcode} of the exit"
        if finished:
            break
    assert finished and opcode > 20
    calls()
    lock.close()


def test_looking_the_exit_up_outside_a_with_statement_changes_nothing(cap):
    """The exit a `with` statement finds releases when it is dropped; one looked up by anyone else (hasattr,
    ExitStack, a kept reference) must neither release early nor leave the lock held."""
    obs = cap.observer
    t = obs.transfer("send", block_ids=[1])
    assert hasattr(t, "__exit__")  # a fresh exit, dropped at once, before the with-block
    with t:
        assert hasattr(t, "__exit__")  # dropped while the block runs: must not release it
        assert not lock_is_free_from_other_thread(obs.lock)
    assert lock_is_free(obs.lock) and t.state == "done"
    with contextlib.ExitStack() as stack:
        entered = stack.enter_context(obs.transfer("send", block_ids=[1]))
        assert not lock_is_free_from_other_thread(obs.lock)
    assert lock_is_free(obs.lock) and entered.state == "done"
    kept_early = obs.transfer("send", block_ids=[1])
    kept = kept_early.__exit__
    with kept_early:
        assert not lock_is_free_from_other_thread(obs.lock)
    del kept
    assert lock_is_free(obs.lock) and kept_early.state == "done"
    assert cap.value(sc.TRANSFERS_TOTAL, path="send", outcome="ok") == 3


@pytest.mark.parametrize("body", ["clean", "raising"])
def test_an_interrupt_at_any_instruction_of_an_async_exit_leaks_nothing(tmp_path, body):
    """The same for `async with`: its exit is awaited, and the interrupt may land before its first instruction.
    The coroutine is driven by hand (nothing in it waits), so no event loop runs under the trace."""
    lock = BlockLock("aexit", 8, directory=tmp_path)
    obs = kvobs.KVObserver("aexit", lock=lock, integrity=None, lock_timeout=0.5, enabled=False)
    calls = _WithBlocks(obs)

    async def block(opcode: int) -> None:
        try:
            async with obs.transfer("send", block_ids=[1, 2]):
                sys.settrace(interrupt_at(opcode, __file__))
                if body == "raising":
                    raise KeyError("the body failed")
        finally:
            sys.settrace(None)

    finished = False
    for opcode in range(1, 10_000):
        try:
            block(opcode).send(None)
        except StopIteration:
            finished = True
        except KeyError:
            finished = True  # the body's own exception came out: the exit ran to its end
        except Interrupt:
            pass
        assert calls.lock_is_free(), f"interrupted before instruction {opcode} of the exit"
        if finished:
            break
    assert finished and opcode > 20
    calls()
    lock.close()


# --- the interrupt storm on guarded calls, and with-blocks exited elsewhere --------------------------------


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
    calls, interrupted, leaked = interrupt_storm(_Calls(obs, "decorator"))
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

    calls, interrupted, lost = interrupt_storm(Calls(obs, "begin"))
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
