"""The cache locks, exercised with real threads, real processes and real signals (no mocks of the lock)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing
import os
import pickle
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import pytest
from support import REPO, hold_in_thread, process_holding

from kvobs import semconv as sc
from kvobs._runtime.atomic import release_now
from kvobs.locks import _polling as polling
from kvobs.locks._cache_lock import CacheLock, Claim, LockTimeout, NullLock, ProcessLock, ThreadLock
from kvobs.testing import capture

HOLDER = """
import sys, time
from kvobs.locks._cache_lock import ProcessLock
lock = ProcessLock(sys.argv[1], directory=sys.argv[2])
if not lock.acquire(timeout=10):
    sys.exit(3)
print("held", flush=True)
time.sleep(60)
"""


def holder(name: str, directory: Path) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    """A separate Python process that takes the lock, says so on stdout, then sleeps until killed."""
    return process_holding(HOLDER, name, str(directory))


# --- cross-process behaviour ---------------------------------------------------------------------------


def test_sigkilled_holder_frees_the_lock(tmp_path: Path) -> None:
    lock = ProcessLock("kv", directory=tmp_path)
    with holder("kv", tmp_path) as proc:
        assert lock.acquire(timeout=0) is False
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL
        assert lock.acquire(timeout=5) is True
        lock.release()
    lock.close()


def test_timeout_while_another_process_holds(tmp_path: Path) -> None:
    lock = ProcessLock("kv", directory=tmp_path, timeout=0.1)
    with holder("kv", tmp_path) as proc:
        started = time.monotonic()
        assert lock.acquire(timeout=0.2) is False
        assert time.monotonic() - started >= 0.195
        started = time.monotonic()
        assert lock.acquire(timeout=0) is False
        assert time.monotonic() - started < 0.1
        with pytest.raises(LockTimeout) as caught:
            with lock:
                pytest.fail("entered a lock another process holds")
        assert "'kv'" in str(caught.value)
        assert caught.value.lock_name == "kv" and caught.value.waited_s == 0.1
        assert lock.held_for() == 0.0
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        # Every failed attempt released the in-process mutex, so the lock is now free to take.
        assert lock.acquire(timeout=5) is True
        lock.release()


def _hammer(lock: CacheLock, inside: list[int], worst: list[int], rounds: int) -> None:
    for _ in range(rounds):
        with lock:
            inside[0] += 1
            worst[0] = max(worst[0], inside[0])
            time.sleep(0)  # drop the GIL inside the critical section, inviting the other thread in
            inside[0] -= 1


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_two_threads_never_overlap(tmp_path: Path, kind: str) -> None:
    lock: CacheLock = ProcessLock("kv", directory=tmp_path) if kind == "process" else ThreadLock()
    inside = [0]
    worst = [0]
    threads = [threading.Thread(target=_hammer, args=(lock, inside, worst, 2000)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert worst[0] == 1 and inside[0] == 0


def test_flock_alone_does_not_exclude_threads_sharing_an_fd(tmp_path: Path) -> None:
    """Why ProcessLock needs its mutex: both threads 'get' an flock on one shared descriptor."""
    fd = os.open(tmp_path / "bare.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        got: list[bool] = []

        def second() -> None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            got.append(True)

        thread = threading.Thread(target=second)
        thread.start()
        thread.join(timeout=10)
        assert got == [True]
    finally:
        os.close(fd)


def _count_under_lock(lock: ProcessLock, inside: Any, overlaps: Any, total: Any, rounds: int) -> None:
    for _ in range(rounds):
        with lock:
            inside.value += 1
            if inside.value > 1:
                overlaps.value += 1
            total.value += 1  # read-modify-write across processes: only exact under exclusion
            time.sleep(0)
            inside.value -= 1


def test_forked_processes_exclude_each_other(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    lock = ProcessLock("kv", directory=tmp_path)  # opened before fork: each child must re-open its own fd
    inside, overlaps, total = (ctx.Value("i", 0, lock=False) for _ in range(3))
    rounds = 1500
    procs = [
        ctx.Process(target=_count_under_lock, args=(lock, inside, overlaps, total, rounds)) for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    _count_under_lock(lock, inside, overlaps, total, rounds)  # the parent takes part too
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    assert overlaps.value == 0
    assert total.value == 3 * rounds


def _child_of_holder(lock: ProcessLock, tried: Any, released: Any, result: Any) -> None:
    not_inherited = lock.held_for() == 0.0 and lock.acquire(timeout=0.1) is False
    tried.set()
    released.wait(10)
    result.value = int(not_inherited and lock.acquire(timeout=5))


def test_lock_held_at_fork_is_not_held_by_child(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    lock = ProcessLock("kv", directory=tmp_path)
    tried = ctx.Event()
    released = ctx.Event()
    result = ctx.Value("i", 0, lock=False)
    assert lock.acquire(timeout=0)
    proc = ctx.Process(target=_child_of_holder, args=(lock, tried, released, result))
    proc.start()
    assert tried.wait(30)  # the child's own attempt (0.1 s) fails while the parent holds
    lock.release()
    released.set()
    proc.join(timeout=30)
    assert proc.exitcode == 0 and result.value == 1
    # The child exited holding its lock; the kernel dropped its flock, and ours was never shared.
    assert lock.acquire(timeout=5)
    lock.release()


def _spawned(lock: ProcessLock, results: Any, go: Any) -> None:
    results.put((lock.path, lock.acquire(timeout=0)))
    go.wait(30)
    results.put(lock.acquire(timeout=5))
    lock.release()


def test_spawned_worker_attaches_by_name_and_excludes_parent(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    lock = ProcessLock("kv", directory=tmp_path)
    results = ctx.Queue()
    go = ctx.Event()
    assert lock.acquire(timeout=0)
    proc = ctx.Process(target=_spawned, args=(lock, results, go))
    proc.start()
    try:
        assert results.get(timeout=30) == (lock.path, False)
        lock.release()
        go.set()
        assert results.get(timeout=30) is True
    finally:
        go.set()
        proc.join(timeout=30)
    assert proc.exitcode == 0


def test_unpickling_attaches_and_never_creates(tmp_path: Path) -> None:
    lock = ProcessLock("kv", directory=tmp_path, timeout=1.5)
    copy = pickle.loads(pickle.dumps(lock))
    assert (copy.name, copy.path, copy.timeout) == ("kv", lock.path, 1.5)
    copy.close()
    os.unlink(lock.path)
    with pytest.raises(FileNotFoundError):
        pickle.loads(pickle.dumps(lock))
    assert not os.path.exists(lock.path)


# --- the lock file -------------------------------------------------------------------------------------


def test_attach_to_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "kvobs-kv.lock"
    with pytest.raises(FileNotFoundError) as caught:
        ProcessLock.attach("kv", directory=tmp_path)
    assert str(path) in str(caught.value) and "create it first" in str(caught.value)
    assert not path.exists()
    owner = ProcessLock("kv", directory=tmp_path)
    attached = ProcessLock.attach("kv", directory=tmp_path)
    assert attached.path == owner.path == str(path)


@pytest.mark.parametrize("via", ["create", "attach"])
def test_symlink_at_lock_path_is_refused(tmp_path: Path, via: str) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("precious")
    target.chmod(0o644)
    (tmp_path / "kvobs-kv.lock").symlink_to(target)
    open_lock = ProcessLock if via == "create" else ProcessLock.attach
    with pytest.raises(PermissionError, match="symlink"):
        open_lock("kv", directory=tmp_path)
    assert target.read_text() == "precious"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


def test_dangling_symlink_creates_nothing(tmp_path: Path) -> None:
    absent = tmp_path / "absent"
    (tmp_path / "kvobs-kv.lock").symlink_to(absent)
    with pytest.raises(PermissionError, match="symlink"):
        ProcessLock("kv", directory=tmp_path)
    assert not absent.exists()


@pytest.mark.parametrize("make", [os.mkdir, os.mkfifo], ids=["directory", "fifo"])
def test_non_regular_file_at_lock_path_is_refused(tmp_path: Path, make: Callable[[Path], None]) -> None:
    make(tmp_path / "kvobs-kv.lock")
    with pytest.raises(PermissionError, match="not a regular file"):
        ProcessLock("kv", directory=tmp_path)


def test_created_file_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        lock = ProcessLock("kv", directory=tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(lock.path).st_mode) == 0o600


def test_existing_file_with_another_mode_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "kvobs-kv.lock"
    path.touch()
    path.chmod(0o666)  # planted in advance: anyone could take the lock and stall every transfer
    with pytest.raises(PermissionError, match="mode 0666, not 0600") as caught:
        ProcessLock("kv", directory=tmp_path)
    assert str(path) in str(caught.value)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666


def test_default_directory_from_env_is_a_private_per_user_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVOBS_LOCK_DIR", str(tmp_path))
    private = tmp_path / f"kvobs-{os.geteuid()}"
    assert ProcessLock("kv").path == str(private / "kvobs-kv.lock")
    assert stat.S_IMODE(private.stat().st_mode) == 0o700


@pytest.mark.parametrize("name", ["", "a/b", "../kv", "a b", "kv\n", "kv\\x", "é", "kv:1"])
def test_invalid_names_are_rejected(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="invalid cache lock name"):
        ProcessLock(name, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_file_planted_by_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("planting a file owned by another user needs root")
    path = tmp_path / "kvobs-kv.lock"
    path.touch(mode=0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(PermissionError, match="owned by uid 65534") as caught:
        ProcessLock("kv", directory=tmp_path)
    assert str(path) in str(caught.value)


def test_name_too_long_for_the_file_system_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="longer than the"):
        ProcessLock("k" * 300, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_unexpected_os_error_opening_the_file_comes_out_unchanged(tmp_path: Path) -> None:
    import errno
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    probe = os.open(os.devnull, os.O_RDONLY)
    os.close(probe)
    resource.setrlimit(resource.RLIMIT_NOFILE, (probe, hard))  # no descriptor number left
    try:
        with pytest.raises(OSError) as caught:
            ProcessLock("kv", directory=tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert type(caught.value) is OSError and caught.value.errno == errno.EMFILE


def test_default_directory_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile
    import uuid

    monkeypatch.delenv("KVOBS_LOCK_DIR", raising=False)
    shm = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK)
    private = os.path.join("/dev/shm" if shm else tempfile.gettempdir(), f"kvobs-{os.geteuid()}")
    name = f"test-{uuid.uuid4().hex}"
    lock = ProcessLock(name)
    try:
        assert lock.path == os.path.join(private, f"kvobs-{name}.lock")
        assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(lock.path).st_mode) == 0o600
        assert lock.acquire(timeout=0)
        lock.release()
    finally:
        lock.close()
        os.unlink(lock.path)


def _use_unlinked_lock(lock: ProcessLock, parent_holds: Any, results: Any) -> None:
    results.put(("while parent holds", lock.acquire(timeout=0.1)))
    parent_holds.wait(30)
    results.put(("after parent released", lock.acquire(timeout=10)))
    lock.release()


def test_forked_child_never_recreates_a_missing_lock_file(tmp_path: Path) -> None:
    """The child re-opens the parent's file (same inode) even after it was unlinked: it still excludes the
    parent, and no new file appears at the path."""
    ctx = multiprocessing.get_context("fork")
    lock = ProcessLock("kv", directory=tmp_path)
    os.unlink(lock.path)
    released = ctx.Event()
    results = ctx.Queue()
    assert lock.acquire(timeout=0)
    proc = ctx.Process(target=_use_unlinked_lock, args=(lock, released, results))
    proc.start()
    try:
        assert results.get(timeout=30) == ("while parent holds", False)
        lock.release()
        released.set()
        assert results.get(timeout=30) == ("after parent released", True)
    finally:
        released.set()
        proc.join(timeout=30)
    assert proc.exitcode == 0
    assert not os.path.exists(lock.path)


def test_threads_with_a_sub_second_timeout_wait_for_the_holder(tmp_path: Path) -> None:
    lock = ProcessLock("kv", directory=tmp_path)
    results = []
    release, holder_thread = hold_in_thread(lock)
    threading.Timer(0.1, release.set).start()  # the holder lets go after 0.1 s
    results.append(lock.acquire(timeout=0.9))  # waits for the thread instead of failing at once
    holder_thread.join(timeout=10)
    assert results == [True]
    lock.release()


class _Interrupt(Exception):
    pass


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise _Interrupt


def test_mutex_is_released_when_the_file_lock_wait_raises(tmp_path: Path) -> None:
    """Ctrl-C while another process holds the flock: the undo steps recorded so far free the in-process
    mutex, so the next thread is not locked out for good."""
    from collections import deque

    from kvobs._runtime.atomic import release_now
    from kvobs.locks._cache_lock import Claim

    lock = ProcessLock("kv", directory=tmp_path)
    previous = signal.signal(signal.SIGALRM, _raise_interrupt)
    try:
        with holder("kv", tmp_path) as proc:
            held: deque[Any] = deque()
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            with pytest.raises(_Interrupt):
                lock.acquire_into(held, Claim("prefetch"), 10.0)
            assert len(held) == 1  # the mutex, and only the mutex: the flock was never taken
            release_now(held)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            other: list[bool] = []
            thread = threading.Thread(target=lambda: other.append(lock.acquire(timeout=5)))
            thread.start()
            thread.join(timeout=30)
            assert other == [True]
            lock.release()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_close_is_idempotent(tmp_path: Path) -> None:
    lock = ProcessLock("kv", directory=tmp_path)
    lock.close()
    lock.close()
    assert os.path.exists(lock.path)  # never unlinked: a new opener must lock the same inode


# --- single-process behaviour ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_acquire_release_held_for_and_with(tmp_path: Path, kind: str) -> None:
    lock: CacheLock = (
        ProcessLock("kv", directory=tmp_path, timeout=0.05) if kind == "process" else ThreadLock(timeout=0.05)
    )
    assert isinstance(lock, CacheLock)
    assert lock.held_for() == 0.0
    assert lock.acquire() is True
    time.sleep(0.01)
    assert lock.held_for() >= 0.01
    other: list[bool] = []
    thread = threading.Thread(target=lambda: other.append(lock.acquire(timeout=0.05)))
    thread.start()
    thread.join(timeout=10)
    assert other == [False]
    with pytest.raises(LockTimeout):
        with lock:
            pass
    lock.release()
    assert lock.held_for() == 0.0
    with pytest.raises(RuntimeError, match="boom"):
        with lock:
            raise RuntimeError("boom")
    assert lock.acquire(timeout=0) is True  # the exception did not leak the lock
    lock.release()
    assert lock.acquire(timeout=-1.0) is True  # an already-expired deadline still tries once
    lock.release()


def test_thread_lock_defaults() -> None:
    lock = ThreadLock()
    assert lock.name == "thread" and lock.timeout is None
    assert ThreadLock("kv").name == "kv"


def test_null_lock_never_blocks() -> None:
    lock = NullLock()
    assert isinstance(lock, CacheLock) and lock.name == "none"
    assert lock.acquire(timeout=0) and lock.acquire()
    with lock, lock:
        assert lock.held_for() == 0.0
    lock.release()


def test_lock_timeout_pickles_and_is_a_timeout_error() -> None:
    error = LockTimeout("kv", 2.0, path="prefetch")
    assert isinstance(error, TimeoutError)
    assert str(error) == "cache lock 'kv' not acquired within 2.000 s (path=prefetch)"
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is LockTimeout
    assert (copy.lock_name, copy.waited_s, copy.path) == ("kv", 2.0, "prefetch")
    assert str(copy) == str(error)
    bare = pickle.loads(pickle.dumps(LockTimeout("kv", 0.5)))
    assert str(bare) == "cache lock 'kv' not acquired within 0.500 s" and bare.path is None


def test_ctrl_c_while_with_lock_waits_for_another_process_leaves_nothing_held(tmp_path: Path) -> None:
    """`with lock:` interrupted while it polls the flock of another process, holding the in-process mutex:
    `with` calls no __exit__ for an __enter__ that raised, so acquire() itself must undo the mutex."""
    lock = ProcessLock("cc", directory=tmp_path)

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    with holder("cc", tmp_path):
        previous = signal.signal(signal.SIGUSR1, interrupt)
        timer = threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                with lock:
                    pass
        finally:
            timer.join()
            signal.signal(signal.SIGUSR1, previous)
    acquired: list[bool] = []
    t = threading.Thread(target=lambda: acquired.append(lock.acquire(5.0)))
    t.start()
    t.join()
    assert acquired == [True]
    lock.release()


def test_acquire_without_a_timeout_waits_the_one_the_lock_was_built_with() -> None:
    lock = ThreadLock("built-with-timeout", timeout=0.2)
    assert lock.acquire()
    try:
        outcome = []
        waiter = threading.Thread(target=lambda: outcome.append(lock.acquire()), daemon=True)
        waiter.start()
        waiter.join(timeout=60)
        assert outcome == [False]  # not a wait for ever
    finally:
        lock.release()


# --- who a waiter waited for -------------------------------------------------------------------------------


KINDS = ["thread", "process"]


def make_lock(kind: str, tmp_path: Path, **options) -> ThreadLock | ProcessLock:
    return ThreadLock("kv", **options) if kind == "thread" else ProcessLock("kv", directory=tmp_path, **options)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=60, check=False)


@pytest.mark.parametrize("kind", KINDS)
def test_a_waiter_is_told_which_path_holds_the_lock(tmp_path, kind):
    lock = make_lock(kind, tmp_path)
    with capture(engine="who", integrity=None, lock=lock, lock_timeout=0.2) as cap:
        inside = threading.Event()
        leave = threading.Event()

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
            from kvobs.locks._cache_lock import ProcessLock
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


# --- waits with no timeout, and with a timeout of exactly one second ---------------------------------------


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


# --- the direct API: `with lock:`, and what a lock says it is ----------------------------------------------


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


def test_the_null_lock_holds_nothing_and_overlaps_nothing():
    lock = NullLock("off")
    with lock as entered:
        assert entered is lock
    assert lock.acquire(0) is True
    lock.release()
    assert lock.overlaps(Claim("prefetch"), Claim("forward")) is False
    assert lock.held_for() == 0.0
    assert lock.acquire_into(deque(), Claim("prefetch"), 0) is True


# --- close() gives the file lock back; a forked child that cannot re-open it -------------------------------


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
        from kvobs.locks._cache_lock import ProcessLock
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
        from kvobs.locks._cache_lock import ProcessLock
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


# --- the back-off of a lock that can only be tried ---------------------------------------------------------


class _Clock:
    """time for kvobs.locks._polling: pauses are recorded and advance a clock instead of sleeping."""

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
