"""Every telemetry failure kvobs swallows is counted, and logged once per kind per interval.

Why: a failing exporter, metric, logger or hook must never reach the engine, but a bare counter says nothing
about what failed. The count stays exact in `kvobs_telemetry_errors_total{stage}`; the log line names the
stage and the exception type, with its traceback, at most once per (stage, exception type) per
`LOG_INTERVAL_S`, so a failure on every call never becomes a line per call. kvobs logs through structlog and
never configures it.

    failed = TelemetryFailures("engine-0", counters)
    try:
        exporter.export(spans)
    except Exception as exc:
        failed("export", exc)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvobs.telemetry._logs import default_logger
from kvobs.telemetry._ratelimit import RateLimitedLog

LOG_INTERVAL_S = 60.0
EVENT_TELEMETRY_FAILED = "kvobs.telemetry.failed"
TELEMETRY_ERRORS_HELP = "Telemetry failures swallowed so the engine call is unaffected."

# The stages a failure is counted under (label `stage` of kvobs_telemetry_errors_total).
STAGE_METRICS = "metrics"
STAGE_TRACING = "tracing"
STAGE_LOGGING = "logging"
STAGE_HOOK = "hook"
STAGE_SCRAPE = "scrape"
STAGE_EXPORT = "export"  # span export; counted under engine="" (it belongs to the process)
# Not telemetry, but counted the same way: a round of the deadline thread (`kvobs._lifecycle.open_transfers`) that raised
# and was restarted, under each observer it watches (it logs the restart itself, once). A metric of its own
# would be one more family to wire through every registry and multiprocess mode for a count that stays 0.
STAGE_DEADLINE_THREAD = "deadline_thread"
TELEMETRY_STAGES = (STAGE_METRICS, STAGE_TRACING, STAGE_LOGGING, STAGE_HOOK, STAGE_SCRAPE, STAGE_EXPORT,
                    STAGE_DEADLINE_THREAD)


# what a collaborator gets to report a swallowed failure: `failed(stage, error)` (a TelemetryFailures, or a
# function that passes on to one)
Failed = Callable[[str, BaseException], None]


class TelemetryFailures:
    """The one place a swallowed telemetry failure goes. `counters` maps a stage to a counter child (anything
    with `inc()`); a stage without one is still logged. Calling it never raises."""

    def __init__(self, engine: str, counters: Mapping[str, Any] | None = None, logger: Any = None,
                 interval_s: float = LOG_INTERVAL_S, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self._counters = counters if counters is not None else {}
        self._log = RateLimitedLog(logger if logger is not None else default_logger(), interval_s, clock=clock,
                                   on_error=self._logging_failed)

    def __call__(self, stage: str, error: BaseException | None = None, *, where: str | None = None) -> None:
        """Count one failure of `stage` and log it unless its kind was logged within the interval. Inside an
        `except` block the exception being handled is used when `error` is not given. `where` names the
        place within the stage (an integration's hook), logged and part of the kind."""
        try:
            self.count(stage)
            if error is None:
                error = sys.exc_info()[1]
            error_type = type(error).__qualname__ if error is not None else None
            place = {} if where is None else {"where": where}
            self._log.log((stage, error_type, where), "warning", EVENT_TELEMETRY_FAILED, engine=self.engine,
                          stage=stage, error_type=error_type, exc_info=error if error is not None else False,
                          **place)
        except Exception:  # noqa: BLE001, S110 - the reporter of last resort must not raise either
            pass

    def count(self, stage: str) -> None:
        """Count one failure of `stage` without logging it (its caller logs it elsewhere, once)."""
        counter = self._counters.get(stage)
        if counter is not None:
            try:
                counter.inc()
            except Exception:  # noqa: BLE001, S110 - a broken counter still leaves the log line
                pass

    def _logging_failed(self) -> None:
        """The logger itself raised: counted under `logging`, never logged (that would fail the same way)."""
        self.count(STAGE_LOGGING)
