"""Log each kind of event at most once per interval, with the count of what was suppressed.

Why: a flood (a million overflowing signals, an exporter failing on every call) must not become a million log
lines, each one written on the engine's own thread. Metrics keep the exact counts; the log
keeps one line per kind per interval, and that line says how many of its kind were left out before it.

    limited = RateLimitedLog(logger, interval_s=10.0, on_error=count_logging_error)
    limited.log("overflow", "warning", "kvobs.signal.dropped", slot=3)   # written
    limited.log("overflow", "warning", "kvobs.signal.dropped", slot=4)   # counted, not written
    # ... 10 s later: written with suppressed=1 (and the fields of this call)

Kinds must be a small fixed set (outcomes, telemetry stages), never request or slot ids: one entry per kind is
kept for the life of the object. What is suppressed after the last line of a kind is never written; the
metrics have it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from kvobs import semconv as sc
from kvobs._runtime.forks import renewed_after_fork

SUPPRESSED_FIELD = sc.LOG_SUPPRESSED


class RateLimitedLog:
    """A `logger` (structlog-style: `logger.warning(event, **fields)`) that writes each kind at most once per
    `interval_s`. Thread-safe; never raises: a failing logger is reported through `on_error`."""

    def __init__(self, logger: Any, interval_s: float = 10.0, *, clock: Callable[[], float] = time.monotonic,
                 on_error: Callable[[], None] | None = None) -> None:
        if not interval_s >= 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s!r}")
        self._logger = logger
        self._interval = interval_s
        self._clock = clock
        self._on_error = on_error
        self._lock = threading.Lock()
        _renewed_after_fork.add(self)
        self._last_written: dict[Hashable, float] = {}
        self._suppressed: dict[Hashable, int] = {}

    def log(self, kind: Hashable, level: str, event: str, **fields: Any) -> bool:
        """Write `event` at `level` unless a line of `kind` was written less than `interval_s` ago; then only
        count it. A written line carries `suppressed=N` when N lines of its kind were left out before it.
        True when the line was written."""
        now = self._clock()
        with self._lock:
            if now - self._last_written.get(kind, -math.inf) < self._interval:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return False
            self._last_written[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            fields[SUPPRESSED_FIELD] = suppressed
        try:
            getattr(self._logger, level)(event, **fields)
        except Exception:  # noqa: BLE001 - logging must never break the caller
            if self._on_error is not None:
                self._on_error()
        return True

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork


_renewed_after_fork = renewed_after_fork(RateLimitedLog._after_fork_in_child)
