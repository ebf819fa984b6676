"""An asynchronous exception (Ctrl-C's KeyboardInterrupt, a signal handler that raises) landing anywhere in a
signal-buffer call never leaves the buffer's lock held: the next call would block the engine forever.

Real signals: a SIGALRM every 30 us whose handler raises, over every operation of both buffers.
"""

from __future__ import annotations

import gc
import signal
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

import kvobs
from kvobs.signals._core import held


class Storm(Exception):
    """Raised by the storm's signal handler between two bytecodes of whatever runs."""


def _storm(operation, seconds: float = 2.0) -> tuple[int, int]:
    """Run `operation(i)` for i = 0, 1, ... under the storm; returns (interrupted calls, calls after which a
    lock was found held, and released by the test to go on)."""
    armed = False
    interrupted = leaked = 0

    def handler(signum, frame):
        if armed:
            raise Storm()

    gc.collect()
    gc.disable()
    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 30e-6, 30e-6)
    start, i = time.monotonic(), 0
    try:
        while time.monotonic() - start < seconds:
            i += 1
            try:
                armed = True
                operation(i)
                armed = False
            except Storm:
                armed = False
                interrupted += 1
            for lock in operation.locks:
                if lock.locked():
                    leaked += 1
                    lock.release()
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, previous)
        gc.enable()
    return interrupted, leaked


class Cycle:
    """Signal, register, finish a few slots in turn: every fast path and every slow one."""

    def __init__(self, buffer) -> None:
        self.buffer = buffer
        # the buffer's lock, and the step-aligned buffer's step lock held around it
        self.locks = [buffer._lock] + ([buffer._step_lock] if hasattr(buffer, "_step_lock") else [])

    def __call__(self, i: int) -> None:
        slot, buffer = i % 32, self.buffer
        try:
            if i % 3 == 0:
                buffer.register(slot, 8)
            buffer.signal(slot, i % 2, 4)
            buffer.signal_batch(0, [slot], [4])
        except ValueError:
            pass  # registered already: that call changed nothing
        if i % 5 == 0:
            buffer.finish(slot)
        if i % 4 == 0 and hasattr(buffer, "end_step"):
            buffer.end_step()


@pytest.mark.parametrize("kind", ["immediate", "step_aligned"])
def test_interrupt_storm_over_signal_buffer_calls_never_leaves_its_lock_held(kind):
    obs = kvobs.KVObserver("storm", registry=CollectorRegistry(), integrity=None)
    buffer = obs.signal_buffer(max_pending=16) if kind == "immediate" else obs.step_aligned_signal_buffer(
        max_pending=16)
    interrupted, leaked = _storm(Cycle(buffer))
    assert interrupted > 500
    assert leaked == 0, f"{leaked} of {interrupted} interrupted calls left the buffer's lock held"


def test_held_takes_and_releases_the_lock_it_wraps_as_with_lock_does():
    lock = threading.Lock()
    with held(lock) as acquired:
        assert acquired is True and lock.locked()
    assert not lock.locked()
    with pytest.raises(KeyError), held(lock):
        raise KeyError("inside")
    assert not lock.locked()
