"""Waiting for a lock that can only be tried: retry with exponential back-off until a deadline.

A blocking ``flock`` or ``F_OFD_SETLKW`` could not honour a deadline, and could not be interrupted cleanly;
a non-blocking attempt retried after short, growing pauses does both, and stays responsive while they are
short.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["poll"]


def poll(attempt: Callable[[], bool], deadline: float | None, first_pause_s: float, max_pause_s: float) -> bool:
    """Retry `attempt` until it succeeds (True) or the `time.monotonic()` deadline passes (False; None: never),
    pausing `first_pause_s` after the first failure, twice as long after each next one, up to `max_pause_s`."""
    pause = first_pause_s
    while not attempt():
        if deadline is None:
            time.sleep(pause)
        else:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(pause, remaining))
        pause = min(pause * 2, max_pause_s)
    return True
