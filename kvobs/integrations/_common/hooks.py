"""The one path for a failure of an integration's own hook code: the engine never sees it.

Through the observer's counted and rate-limited telemetry failures (`KVObserver.hook_failed`): every
swallowed failure is counted in `kvobs_telemetry_errors_total{stage="hook"}`, and logged with where it
happened at most once per interval per (where, error type), so a hook failing on every call never becomes a
line per call. A hook that belongs to no observer (a signal bridge) is logged the same way, uncounted.
"""

from __future__ import annotations

from typing import Any

from kvobs.telemetry._failures import STAGE_HOOK, TelemetryFailures
from kvobs.telemetry._logs import default_logger


class HookFailures:
    """`failed(where, error)`: report a hook failure swallowed so the engine goes on. Never raises."""

    def __init__(self, obs: Any = None, *, logger: Any = None) -> None:
        if obs is not None:
            self._report = obs.hook_failed
        else:
            failures = TelemetryFailures("", None, logger if logger is not None else default_logger())
            self._report = lambda error, where: failures(STAGE_HOOK, error, where=where)

    def __call__(self, where: str, error: BaseException) -> None:
        self._report(error, where=where)
