"""Lock behaviours that a sampled mutation run of kvobs.locks showed no test pinned down: who a waiter is told
it waited for, waits with no timeout or a timeout of exactly one second, the direct `with lock:` API, what
`close()` gives back, and a forked child whose lock file cannot be re-opened.

Real threads and real processes throughout; each test fails on a mutant the other lock tests let through.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections import deque
from pathlib import Path

import pytest
from support import hold_in_thread

from kvobs import polling
from kvobs import semconv as sc
from kvobs.atomic import release_now
from kvobs.locks import Claim, LockTimeout, NullLock, ProcessLock, ThreadLock
from kvobs.testing import capture

REPO = Path(__file__).resolve().parents[1]
KINDS = ["thread", "process"]


def make_lock(kind: str, tmp_path: Path, **options) -> ThreadLock | ProcessLock:
    return ThreadLock("kv", **options) if kind == "thread" else ProcessLock("kv", directory=tmp_path, **options)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=60, check=False)


# -- who a waiter waited for ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_waiter_is_told_which_path_holds_the_lock(tmp_path, kind):
    lock = make_lock(kind, tmp_path)
    with capture(engine="who", integrity=None, lock=lock, lock_timeout=0.2) as cap:
        inside, leave = threading.Event(), threading.Event()

        @cap.observer.write_back(block_ids="ids")
        def write(ids):
            inside.set()
            leave.wait(10)

        @cap.observer.prefetch(block_ids="ids")
        def fetch(ids):
            return "fetched"

        writer = threading.Thread(target=write, args=([1],))
        writer.start()
        assert inside.wait(10)
        try:
            with pytest.raises(LockTimeout):
                fetch([2])
        finally:
            leave.set()
            writer.join()
        assert cap.value(sc.LOCK_CONFLICTS_TOTAL, lock="kv", path="prefetch", holder_path="write_back") == 1
        assert fetch([2]) == "fetched"  # uncontended now: no conflict counted
        assert cap.value(sc.LOCK_CONFLICTS_TOTAL, lock="kv", path="prefetch", holder_path="write_back") == 1
        assert cap.value(sc.LOCK_CONFLICTS_TOTAL, lock="kv", path="write_back", holder_path="unknown") is None


def test_an_uncontended_process_lock_counts_no_conflict(tmp_path):
    with capture(engine="calm", integrity=None, lock=ProcessLock("kv", directory=tmp_path)) as cap:
        @cap.observer.send(block_ids="ids")
        def send(ids):
            return "sent"

        for i in range(3):
            assert send([i]) == "sent"
        conflicts = [s for m in cap.registry.collect() for s in m.samples
                     if s.name == sc.LOCK_CONFLICTS_TOTAL and s.value]
        assert conflicts == []


def test_a_holder_in_another_process_is_reported_as_unknown(tmp_path):
    ready = tmp_path / "ready"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from kvobs.locks import ProcessLock
            lock = ProcessLock("kv", directory={str(tmp_path)!r})
            assert lock.acquire(10)
            open({str(ready)!r}, "w").close()
            time.sleep(60)
        """)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
    )
    try:
        while not ready.exists():
            assert holder.poll() is None, "the holder process died"
            threading.Event().wait(0.01)
        with capture(engine="far", integrity=None, lock=ProcessLock("kv", directory=tmp_path),
                     lock_timeout=0.2) as cap:
            @cap.observer.prefetch(block_ids="ids")
            def fetch(ids):
                return "fetched"

            with pytest.raises(LockTimeout):
                fetch([1])
            assert cap.value(sc.LOCK_CONFLICTS_TOTAL, lock="kv", path="prefetch", holder_path="unknown") == 1
    finally:
        holder.kill()
        holder.wait()


# -- waits with no timeout, and with a timeout of exactly one second -------------------------------------------


@pytest.mark.parametrize("timeout", [None, 1.0, 1])
@pytest.mark.parametrize("kind", KINDS)
def test_a_contended_acquire_waits_for_the_holder(tmp_path, kind, timeout):
    lock = make_lock(kind, tmp_path)
    release, holder = hold_in_thread(lock)
    waiting = threading.Event()  # set by the conflict report, just before the waiter blocks
    held: deque = deque()
    result = []
    waiter = threading.Thread(
        target=lambda: result.append(lock.acquire_into(held, Claim("waiter"), timeout, lambda who: waiting.set())))
    waiter.start()
    assert waiting.wait(10)
    release.set()
    holder.join()
    waiter.join(10)
    assert result == [True]
    release_now(held)
    assert lock.acquire(0)
    lock.release()


# -- the direct API: `with lock:` ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_with_lock_gives_the_lock_itself(tmp_path, kind):
    lock = make_lock(kind, tmp_path)
    with lock as entered:
        assert entered is lock
    assert lock.acquire(0)
    lock.release()


@pytest.mark.parametrize("kind", KINDS)
def test_with_a_zero_timeout_lock_that_is_held_raises_at_once_saying_zero_seconds(tmp_path, kind):
    lock = make_lock(kind, tmp_path, timeout=0)
    release, holder = hold_in_thread(lock)
    try:
        with pytest.raises(LockTimeout) as info, lock:
            raise AssertionError("never entered")
    finally:
        release.set()
        holder.join()
    assert info.value.lock_name == "kv"
    assert info.value.waited_s == 0.0
    assert "within 0.000 s" in str(info.value)


@pytest.mark.parametrize("kind", KINDS)
def test_releasing_a_lock_that_acquire_never_took_is_a_clear_error(tmp_path, kind):
    lock = make_lock(kind, tmp_path)
    with pytest.raises(RuntimeError, match="which acquire\\(\\) does not hold"):
        lock.release()
    assert lock.acquire(0)  # the failed release took nothing away and broke nothing
    lock.release()
    with pytest.raises(RuntimeError, match="does not hold"):
        lock.release()  # released once: a second release is the same clear error


def test_locks_say_what_they_are(tmp_path):
    assert repr(ThreadLock("kv")) == "ThreadLock('kv')"
    assert repr(NullLock("off")) == "NullLock('off')"
    lock = ProcessLock("kv", directory=tmp_path)
    assert repr(lock) == f"ProcessLock('kv', path={lock.path!r})"
    assert lock.path.startswith(str(tmp_path))


# -- close() gives the file lock back --------------------------------------------------------------------------


def test_close_drops_the_file_lock_it_held(tmp_path):
    lock = ProcessLock("kv", directory=tmp_path)
    other = ProcessLock.attach("kv", directory=tmp_path)  # its own open file description
    assert lock.acquire(0)
    assert not other.acquire(0)
    lock.close()
    assert other.acquire(0)
    other.release()
    other.close()


def test_close_drops_the_file_lock_when_its_descriptor_is_zero(tmp_path):
    """A daemon that closed stdin gets descriptor 0 for its lock file: close() must close that one too."""
    result = run_python(f"""
        import os
        os.close(0)
        from kvobs.locks import ProcessLock
        lock = ProcessLock("kv", directory={str(tmp_path)!r})
        assert lock._fd == 0, lock._fd
        assert lock.acquire(0)
        lock.close()
        other = ProcessLock.attach("kv", directory={str(tmp_path)!r})
        print("free" if other.acquire(0) else "still held")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "free"


def test_a_forked_child_that_cannot_reopen_its_lock_file_is_warned_and_never_shares_the_parents_lock(tmp_path):
    """With no descriptor left to re-open the file, the child's lock must fail on use (not share the
    parent's flock, which would let parent and child hold "the" lock at once) and say why."""
    result = run_python(f"""
        import errno, json, os, resource, warnings
        from kvobs.locks import ProcessLock
        lock = ProcessLock("kv", directory={str(tmp_path)!r})
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(int(n) for n in os.listdir("/proc/self/fd")) + 1, hard))
        spare = []
        while True:  # use up every descriptor the limit allows: the child's re-open gets EMFILE
            try:
                spare.append(os.open("/dev/null", os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
                break
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pid = os.fork()
            if pid == 0:
                messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
                try:
                    took = lock.acquire(0)
                except Exception as exc:  # fd -1: refused on use
                    took = type(exc).__name__
                os.write(1, json.dumps([messages, took]).encode())
                os._exit(0)
        os.waitpid(pid, 0)
    """)
    assert result.returncode == 0, result.stderr
    messages, took = json.loads(result.stdout)
    assert took is not True  # no descriptor: the lock is refused on use, so it is never shared
    assert len(messages) == 1 and "cannot re-open" in messages[0] and "kvobs-kv" in messages[0]


@pytest.mark.parametrize("kind", KINDS)
def test_the_first_holder_of_a_new_lock_is_unknown_until_it_has_noted_itself(tmp_path, kind):
    """Between taking the mutex and noting who it is, a holder is anonymous: a waiter that looks then at a
    new lock (or a forked child's fresh one) is told "unknown", not an error. Here the mutex is taken
    directly, as at the very start of an acquisition."""
    lock = make_lock(kind, tmp_path)
    mutex = lock._lock if kind == "thread" else lock._mutex
    assert mutex.acquire(False)
    try:
        conflicts: list[str] = []
        assert not lock.acquire_into(deque(), Claim("waiter"), 0, conflicts.append)
        assert conflicts == ["unknown"]
        assert lock.held_for() == 0.0  # no start noted yet: not "held since the clock's epoch"
    finally:
        mutex.release()


def test_the_null_lock_holds_nothing_and_overlaps_nothing():
    lock = NullLock("off")
    with lock as entered:
        assert entered is lock
    assert lock.acquire(0) is True
    lock.release()
    assert lock.overlaps(Claim("prefetch"), Claim("forward")) is False
    assert lock.held_for() == 0.0
    assert lock.acquire_into(deque(), Claim("prefetch"), 0) is True


# -- the back-off of a lock that can only be tried --------------------------------------------------------------


class _Clock:
    """time for kvobs.polling: pauses are recorded and advance a clock instead of sleeping."""

    def __init__(self) -> None:
        self.now = 100.0
        self.pauses: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def _attempts(failures: int):
    calls = []

    def attempt() -> bool:
        calls.append(1)
        assert len(calls) < 100, "polled on and on without pausing"
        return len(calls) > failures

    return attempt, calls


@pytest.mark.parametrize("deadline", [None, 1e9])
def test_polling_pauses_double_up_to_the_cap_until_the_attempt_succeeds(monkeypatch, deadline):
    clock = _Clock()
    monkeypatch.setattr(polling, "time", clock)
    attempt, calls = _attempts(failures=6)
    assert polling.poll(attempt, deadline, 1.0, 8.0) is True
    assert len(calls) == 7
    assert clock.pauses == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_polling_stops_at_the_deadline_and_never_pauses_past_it(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(polling, "time", clock)
    attempt, calls = _attempts(failures=1000)
    assert polling.poll(attempt, clock.now + 10.0, 1.0, 8.0) is False
    assert clock.pauses == [1.0, 2.0, 4.0, 3.0]  # the last pause ends exactly at the deadline
    assert len(calls) == 5  # one try at the deadline itself, then no more
    assert polling.poll(lambda: True, clock.now - 1.0, 1.0, 8.0) is True  # a free lock is taken, deadline or not
