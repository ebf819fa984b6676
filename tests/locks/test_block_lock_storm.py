"""Asynchronous exceptions: a signal handler raising every 30 us (the storm), and an exception injected
before each bytecode of a claim in turn, must never leave a claimed block, a record or a pooled
description behind.

The interrupts land in kvobs's code (and this test's), never in Python code the interpreter runs on the side
(a gc callback, a weakref callback): an exception raised there cannot reach the claim, the interpreter only
reports it as unraisable. A unraisable exception fails these tests, so an interrupt that did not reach
the claim can never pass unnoticed.
"""

from __future__ import annotations

import fcntl
import functools
import gc
import os
import random
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import kvobs
from kvobs._runtime.atomic import release_now
from kvobs.locks import _ofd as ofd
from kvobs.locks._block_descriptions import MAX_IDLE
from kvobs.locks._block_lock import BlockLock
from kvobs.locks._cache_lock import Claim

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")

STORM_S = 2.0
CLAIMS = (
    Claim("prefetch", (1, 2, 3, 10, 11, 20)),
    Claim("send", (2, 3, 4), exclusive=False),
    Claim("forward", tuple(range(0, 64, 3))),
    Claim("write_back", (), exclusive=False),
)


class Interrupt(Exception):
    pass


# Python code the collector runs in the middle of a claim, as libraries register (hypothesis does); compiled
# under a file name of its own, since it stands for another library's code.
_on_gc = eval(compile("lambda phase, info: info.get('generation')", "<a library's gc callback>", "eval"))


_CLAIM_CODE = (os.path.dirname(kvobs.__file__) + os.sep, __file__)


def _in_claim_code(frame: FrameType | None) -> bool:
    """Whether `frame` runs kvobs's code or this test's, where an exception reaches the claim's caller."""
    return frame is not None and frame.f_code.co_filename.startswith(_CLAIM_CODE)


@pytest.fixture(autouse=True)
def gc_runs_python_code() -> Any:
    """Collections often, each running a Python gc callback: where an interrupt would be unraisable."""
    threshold = gc.get_threshold()
    gc.set_threshold(50, 1, 1)
    gc.callbacks.append(_on_gc)
    try:
        yield
    finally:
        gc.callbacks.remove(_on_gc)
        gc.set_threshold(*threshold)


def _contend(lock: BlockLock, stop: threading.Event) -> None:
    """Another holder on overlapping blocks, so that claims also wait, poll and queue at the turnstile."""
    shapes = (Claim("send", (2, 3), exclusive=False), Claim("prefetch", (11, 12)), Claim("forward", (3, 30)))
    turn = 0
    while not stop.is_set():
        held: deque[Any] = deque()
        if lock.acquire_into(held, shapes[turn % len(shapes)], 0.01):
            time.sleep(0.0005)
            release_now(held)
        turn += 1
        time.sleep(0.0002)


def test_interrupt_storm_leaks_no_claim(tmp_path: Path) -> None:
    lock = BlockLock("kv", 64, directory=tmp_path)
    contender_view = BlockLock.attach("kv", 64, directory=tmp_path)
    rng = random.Random(0)
    armed = [0]  # signals to let pass before raising; 0: disarmed
    interrupts = [0]
    interrupted_holding = [0]  # interrupts that landed after something was already recorded

    def raise_when_armed(signum: int, frame: FrameType | None) -> None:
        if armed[0] and _in_claim_code(frame):
            armed[0] -= 1
            if not armed[0]:  # one exception per attempt; the bookkeeping below runs disarmed
                interrupts[0] += 1
                raise Interrupt

    stop = threading.Event()
    contender = threading.Thread(target=_contend, args=(contender_view, stop))
    contender.start()
    previous = signal.signal(signal.SIGALRM, raise_when_armed)
    attempts = granted = 0
    try:
        signal.setitimer(signal.ITIMER_REAL, 30e-6, 30e-6)
        end = time.monotonic() + STORM_S
        while time.monotonic() < end:
            held: deque[Any] = deque()
            wait_signals = rng.randint(1, 4)  # so the interrupt lands anywhere in the claim, not just early
            try:
                armed[0] = wait_signals
                if lock.acquire_into(held, CLAIMS[attempts % len(CLAIMS)], 0.002):
                    granted += 1
                    release_now(held)
                armed[0] = 0
            except Interrupt:
                interrupted_holding[0] += bool(held)
            release_now(held)  # what the lifecycle's finally does with whatever the attempt recorded
            attempts += 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        armed[0] = 0
        signal.signal(signal.SIGALRM, previous)
        stop.set()
        contender.join(timeout=30)

    summary = f"{attempts} attempts, {granted} granted, {interrupts[0]} interrupted ({interrupted_holding[0]} holding)"
    assert interrupts[0] >= 200 and interrupted_holding[0] >= 20, summary
    # Nothing leaked in this process: no record, every description back in the pool exactly once.
    assert lock.blocks_claimed() == {"shared": 0, "exclusive": 0} and lock.held_for() == 0.0, summary
    pool = lock._descriptions
    assert len(pool.idle) == len(set(pool.idle)) == len(pool.opened), summary
    # Nor in the kernel: another description gets the whole cache, exclusive, at once.
    everything: deque[Any] = deque()
    assert contender_view.acquire_into(everything, Claim("check", ()), 0), summary
    release_now(everything)
    lock.close()
    contender_view.close()


# --- every bytecode boundary, deterministically -----------------------------------------------------------


def _interrupt_at(opcode: int, fired: list[bool]) -> Callable[..., Any]:
    """A trace function that raises Interrupt before the `opcode`-th instruction executed in kvobs's (or this
    test's) frames entered from now on, and sets `fired[0]`: exactly what a signal handler raising at that
    boundary would do."""
    executed = [0]

    def trace(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if not _in_claim_code(frame):
            return None
        frame.f_trace_opcodes = True
        if event == "opcode":
            executed[0] += 1
            if executed[0] == opcode:
                fired[0] = True
                raise Interrupt
        return trace

    return trace


def _release_ignoring_holder(blocking: deque[Any], holder: str) -> None:
    release_now(blocking)


def _queue_writer_at(lock: BlockLock, block: int) -> deque[Any]:
    """A description holding `block`'s turnstile byte, as a writer queued there would."""
    fd = os.open(f"/proc/self/fd/{lock._descriptions.base}", os.O_RDWR | os.O_CLOEXEC)
    fcntl.fcntl(fd, ofd.F_OFD_SETLK, ofd.pack(fcntl.F_WRLCK, lock.num_blocks + block, 1))
    return deque([functools.partial(os.close, fd)])


WRITER = Claim("forward", (1, 2, 5, 9, 10))
READER = Claim("write_back", (4, 5), exclusive=False)


@pytest.mark.parametrize(
    ("claim", "blocker", "granted_after_wait"),
    [
        (WRITER, None, True),
        (Claim("send", (1, 2, 5), exclusive=False), None, True),
        (Claim("forward", ()), None, True),
        (WRITER, Claim("send", (5,), exclusive=False), True),  # holds runs 1-2, waits at run 3, queues
        (WRITER, Claim("send", (5,), exclusive=False), False),
        (READER, Claim("prefetch", (5,)), True),
        (READER, Claim("prefetch", (5,)), False),
        (READER, "queued writer", True),
        (READER, "queued writer", False),
    ],
    ids=[
        "writer", "reader", "whole", "writer-waits", "writer-times-out", "reader-waits", "reader-times-out",
        "reader-queues", "reader-queues-times-out",
    ],
)
@pytest.mark.parametrize("pool", ["empty", "warm", "over the idle bound"])
def test_an_interrupt_at_any_bytecode_leaks_nothing(
    tmp_path: Path, claim: Claim, blocker: Claim | str | None, granted_after_wait: bool, pool: str
) -> None:
    """For n = 1, 2, ...: interrupt the claim before its n-th instruction, run the undo steps it recorded,
    check that nothing is claimed; until a claim runs to its end uninterrupted. Each n starts from the same
    state (a freshly opened lock, its pool empty, holding one idle description, or more than it keeps)."""
    view = BlockLock("kv", 16, directory=tmp_path)  # the blocker's and the checker's own descriptions
    view._descriptions.grow()  # its one description, opened before the descriptors are counted
    for opcode in range(1, 100_000):
        descriptors_before = len(os.listdir("/proc/self/fd"))
        lock = BlockLock.attach("kv", 16, directory=tmp_path)
        for _ in range({"empty": 0, "warm": 1}.get(pool, MAX_IDLE + 1)):
            lock._descriptions.grow()
        blocking: deque[Any] = deque()
        if blocker == "queued writer":
            blocking = _queue_writer_at(view, 5)
        elif isinstance(blocker, Claim):
            assert view.acquire_into(blocking, blocker, 0)
        # The blocker goes away the moment the claim reports the conflict (or never, for the timeout case).
        on_conflict = functools.partial(_release_ignoring_holder, blocking) if granted_after_wait else None
        held: deque[Any] = deque()
        finished = False
        fired = [False]
        sys.settrace(_interrupt_at(opcode, fired))
        try:
            result = lock.acquire_into(held, claim, 0.001, on_conflict)
            finished = True
        except Interrupt:
            pass
        finally:
            sys.settrace(None)
        assert not finished or result is (granted_after_wait or blocker is None)
        assert finished is not fired[0], f"the interrupt at opcode {opcode} did not reach the claim"
        release_now(held)
        release_now(blocking)
        assert lock.blocks_claimed() == {"shared": 0, "exclusive": 0}, f"record leaked at opcode {opcode}"
        descriptions = lock._descriptions
        assert len(descriptions.idle) == len(set(descriptions.idle)) == len(descriptions.opened), f"opcode {opcode}"
        everything: deque[Any] = deque()
        assert view.acquire_into(everything, Claim("check", ()), 0), f"a range leaked at opcode {opcode}"
        release_now(everything)
        lock.close()
        assert len(os.listdir("/proc/self/fd")) == descriptors_before, f"a descriptor leaked at opcode {opcode}"
        if finished:
            break
    assert finished and opcode > 20
    view.close()
