"""Interrupts for tests: asynchronous exceptions landing where a raising signal handler (Ctrl-C) could land.

`interrupt_at` sweeps every instruction deterministically (a trace function), raising only in kvobs's frames and
the test's own: an exception in another library's code (a gc callback) is only reported as unraisable and tests
nothing. `interrupt_storm` sends real SIGALRMs, at the start of each call or spread over it, with the cyclic gc
off for the same reason.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

import kvobs

_KVOBS_CODE = os.path.dirname(kvobs.__file__) + os.sep


class Interrupt(Exception):
    """Raised by `interrupt_at`'s trace function before the chosen instruction."""


def interrupt_at(opcode: int, test_file: str) -> Callable[..., Any]:
    """A trace function raising Interrupt before the `opcode`-th instruction run in kvobs's or `test_file`'s
    frames entered from now on (install it with sys.settrace): what a signal handler raising there would do. A
    real one can only land where the interpreter checks for signals; this lands on every instruction, a
    stricter test."""
    own_code = (_KVOBS_CODE, test_file)
    executed = [0]

    def trace(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if not frame.f_code.co_filename.startswith(own_code):
            return None
        frame.f_trace_opcodes = True
        if event == "opcode":
            executed[0] += 1
            if executed[0] == opcode:
                raise Interrupt
        return trace

    return trace


class StormedCalls(Protocol):
    """What `interrupt_storm` calls: one call per round, then a check that nothing is held, and a recovery."""

    def __call__(self) -> None: ...

    def lock_is_free(self) -> bool: ...

    def recover(self) -> None: ...


class Storm(Exception):
    """Raised by the storm's signal handler between two bytecodes of whatever runs."""


def interrupt_storm(calls: StormedCalls, seconds: float = 1.5, interrupted_calls: int = 600,
                    max_seconds: float = 15.0, spread: int = 1) -> tuple[int, int, int]:
    """Run `calls()` under a SIGALRM every 30 us whose handler raises, as Ctrl-C's does, for `seconds` and until
    at least `interrupted_calls` were interrupted (at most `max_seconds`, on a very loaded machine); after each
    call, probe the lock and recover what leaked. Each call lets a random 0 to `spread` - 1 signals pass
    before one raises: with `spread=1` the first signal after the call began raises; a larger spread lands the
    interrupts all over the call, its exit included, not only at its start. Returns (calls, interrupted,
    leaked)."""
    rng = random.Random(22)
    armed = [0]  # signals still to let pass before raising; 0: disarmed
    done = 0
    interrupted = 0
    leaked = 0

    def handler(signum, frame):
        if armed[0]:
            armed[0] -= 1
            if not armed[0]:
                raise Storm()

    gc.collect()  # finalizers of other tests' garbage must not run (and be interrupted) during the storm
    gc.disable()
    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 30e-6, 30e-6)
    start = time.monotonic()
    try:
        while (interrupted < interrupted_calls or time.monotonic() - start < seconds) \
                and time.monotonic() - start < max_seconds:
            done += 1
            try:
                armed[0] = rng.randint(1, spread)
                calls()
                armed[0] = 0
            except Storm:
                armed[0] = 0
                interrupted += 1
            if not calls.lock_is_free():
                leaked += 1
                calls.recover()
    finally:
        armed[0] = 0
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, previous)
        gc.enable()
    return done, interrupted, leaked
