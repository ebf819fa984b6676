"""The cache locks, exercised with real threads, real processes and real signals (no mocks of the lock)."""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import os
import pickle
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from support import hold_in_thread, process_holding

from kvobs.locks import CacheLock, LockTimeout, NullLock, ProcessLock, ThreadLock

HOLDER = """
import sys, time
from kvobs.locks import ProcessLock
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
    inside, worst = [0], [0]
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
    tried, released, result = ctx.Event(), ctx.Event(), ctx.Value("i", 0, lock=False)
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
    results, go = ctx.Queue(), ctx.Event()
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
    released, results = ctx.Event(), ctx.Queue()
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

    from kvobs.atomic import release_now
    from kvobs.locks import Claim

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
