"""`with lock:` on a lock used directly (ThreadLock, ProcessLock, a BlockLock claim) never leaks it when an
asynchronous exception lands anywhere in the with-statement's entry or exit: the README's "never leaked by an
asynchronous exception"."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from typing import Any

import pytest
from interrupts import Interrupt, interrupt_at, interrupt_storm
from support import lock_is_free_from_other_thread

from kvobs.errors import LockTimeout
from kvobs.locks._block_lock import BlockLock
from kvobs.locks._cache_lock import ProcessLock, ThreadLock

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


class _Direct:
    """`with lock:` on a ThreadLock or ProcessLock."""

    def __init__(self, lock: ThreadLock | ProcessLock) -> None:
        self.lock = lock

    def context(self) -> Any:
        return self.lock

    def is_free(self) -> bool:
        return lock_is_free_from_other_thread(self.lock)

    def recover(self) -> None:
        """Today's leak sits in the lock's direct record: release it so the sweep can go on and count."""
        with contextlib.suppress(RuntimeError):
            self.lock.release()


class _BlockClaim:
    """`with block_lock.claim(...)`: the claim object is made inside the traced region too."""

    def __init__(self, lock: BlockLock) -> None:
        self.lock = lock
        self.claims: list[Any] = []

    def context(self) -> Any:
        claim = self.lock.claim([1, 2], timeout=0.5)
        self.claims.append(claim)
        return claim

    def is_free(self) -> bool:
        result = []

        def take() -> None:
            try:
                with self.lock.claim([1, 2], timeout=0):
                    result.append(True)
            except LockTimeout:
                result.append(False)

        thread = threading.Thread(target=take)
        thread.start()
        thread.join()
        return result[0]

    def recover(self) -> None:
        for claim in self.claims:
            claim.release()
        self.claims.clear()


@pytest.fixture(params=["thread", "process", "block"])
def subject(request, tmp_path):
    if request.param == "thread":
        yield _Direct(ThreadLock("direct", timeout=0.5))
    elif request.param == "process":
        lock = ProcessLock("direct", directory=tmp_path, timeout=0.5)
        yield _Direct(lock)
        lock.close()
    else:
        lock = BlockLock("direct", 8, directory=tmp_path)
        yield _BlockClaim(lock)
        lock.close()


def _free_in_another_process(subject: Any, tmp_path: Any) -> bool:
    """The kernel's view: another process can take the lock at once."""
    if isinstance(subject, _Direct) and isinstance(subject.lock, ProcessLock):
        code = (
            "import sys; from kvobs.locks._cache_lock import ProcessLock\n"
            "sys.exit(0 if ProcessLock('direct', directory=sys.argv[1]).acquire(0) else 1)"
        )
    elif isinstance(subject, _BlockClaim):
        code = (
            "import sys; from kvobs.locks._block_lock import BlockLock; l = BlockLock('direct', 8, directory=sys.argv[1])\n"
            "with l.claim([1, 2], timeout=0): pass"
        )
    else:
        return True  # a ThreadLock has no meaning outside its process
    return subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=60).returncode == 0


@pytest.mark.parametrize("phase", ["enter", "exit"])
def test_an_interrupt_at_any_instruction_of_a_with_lock_leaks_nothing(subject, phase, tmp_path):
    """For n = 1, 2, ...: interrupt before the n-th instruction of the with-statement's entry (the exit's
    lookup, the claim's creation, `__enter__`) or of its exit, until one runs to its end. After each round the
    lock is free from another thread, and in the end from another process; the next `with` works."""
    leaked: list[int] = []
    finished = False
    for opcode in range(1, 10_000):
        try:
            if phase == "enter":
                sys.settrace(interrupt_at(opcode, __file__))
            with subject.context():
                if phase == "enter":
                    sys.settrace(None)
                    finished = True
                else:
                    sys.settrace(interrupt_at(opcode, __file__))
            finished = True
        except Interrupt:
            pass
        finally:
            sys.settrace(None)
        if not subject.is_free():
            leaked.append(opcode)
            subject.recover()
        if finished:
            break
    assert finished and opcode > 5, opcode
    assert not leaked, f"{len(leaked)} of {opcode - 1} interrupted rounds left the lock held (at {leaked})"
    assert _free_in_another_process(subject, tmp_path)
    with subject.context():
        assert not subject.is_free()
    assert subject.is_free()


def test_looking_the_exit_up_outside_a_with_statement_changes_nothing(subject):
    """The exit a `with` statement finds releases when dropped; one looked up by anyone else (hasattr, a kept
    reference, ExitStack's lookup on the class) neither releases early nor leaves the lock held."""
    context = subject.context()
    assert hasattr(context, "__exit__")  # a fresh exit, dropped at once, before the with-block
    with context:
        assert hasattr(context, "__exit__")  # dropped while the block runs: must not release it
        assert not subject.is_free()
    assert subject.is_free()
    with contextlib.ExitStack() as stack:
        stack.enter_context(subject.context())
        assert not subject.is_free()
    assert subject.is_free()
    context = subject.context()
    kept = context.__exit__
    with context:
        assert not subject.is_free()
    del kept
    assert subject.is_free()


class _StormedWith:
    """`with lock: pass` for the signal storm (`interrupts.interrupt_storm`), the body empty so that the
    signals land on the entry and the exit."""

    def __init__(self, subject: Any) -> None:
        self.subject = subject

    def __call__(self) -> None:
        with self.subject.context():
            pass

    def lock_is_free(self) -> bool:
        return self.subject.is_free()

    def recover(self) -> None:
        self.subject.recover()


def test_a_real_signal_storm_on_direct_with_locks_leaks_nothing(subject):
    """Real SIGALRMs every 30 us, each call letting 1-60 pass before one raises."""
    calls = _StormedWith(subject)
    rounds, interrupted, leaked = interrupt_storm(calls, seconds=2.0, interrupted_calls=300, spread=60)
    assert interrupted >= 100, (rounds, interrupted)  # aims at 300 within 15 s; a bare with-lock is brief
    assert leaked == 0, f"{leaked} of {interrupted} interrupted with-locks left the lock held ({rounds} rounds)"
    assert calls.lock_is_free()
    calls()
