"""RateLimitedLog: one line per kind per interval, carrying how many were left out; thread-safe; never raises."""

from __future__ import annotations

import threading

import pytest
from signals_support import FakeClock, RecordingLogger

from kvobs.telemetry._ratelimit import SUPPRESSED_FIELD, RateLimitedLog


def test_each_kind_is_written_once_per_interval_with_the_count_left_out():
    logger, clock = RecordingLogger(), FakeClock()
    log = RateLimitedLog(logger, interval_s=10.0, clock=clock)
    assert log.log("overflow", "warning", "dropped", slot=1) is True
    assert [log.log("overflow", "warning", "dropped", slot=s) for s in range(2, 6)] == [False] * 4
    assert log.log("expired", "warning", "dropped", slot=9) is True  # another kind has its own interval
    clock.advance(9.5)
    assert log.log("overflow", "warning", "dropped", slot=6) is False
    clock.advance(0.5)
    assert log.log("overflow", "error", "dropped", slot=7) is True
    assert log.log("overflow", "warning", "dropped", slot=8) is False
    assert logger.records == [
        ("warning", "dropped", {"slot": 1}),
        ("warning", "dropped", {"slot": 9}),
        ("error", "dropped", {"slot": 7, SUPPRESSED_FIELD: 5}),  # slots 2-6 were left out before it
    ]


def test_many_threads_in_one_interval_write_one_line_and_lose_no_count():
    logger, clock = RecordingLogger(), FakeClock()
    log = RateLimitedLog(logger, interval_s=1.0, clock=clock)
    threads = [threading.Thread(target=lambda: [log.log("k", "warning", "e") for _ in range(5000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(logger.records) == 1
    clock.advance(1.0)
    log.log("k", "warning", "e")
    assert logger.records[-1] == ("warning", "e", {SUPPRESSED_FIELD: 4 * 5000 - 1})


def test_a_failing_logger_is_reported_and_never_raises():
    failures = []

    class Broken:
        def warning(self, event, **fields):
            raise OSError("stdout is closed")

    log = RateLimitedLog(Broken(), clock=FakeClock(), on_error=lambda: failures.append(1))
    assert log.log("k", "warning", "e") is True
    assert log.log("k", "warning", "e") is False  # the interval holds whether or not the write worked
    assert failures == [1]
    RateLimitedLog(Broken()).log("k", "warning", "e")  # no on_error: swallowed all the same


def test_interval_zero_writes_everything_and_a_negative_one_is_an_error():
    logger = RecordingLogger()
    log = RateLimitedLog(logger, interval_s=0.0, clock=FakeClock())
    for _ in range(3):
        log.log("k", "info", "e")
    assert len(logger.records) == 3 and all(SUPPRESSED_FIELD not in kw for _, _, kw in logger.records)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="interval_s must be >= 0"):
            RateLimitedLog(logger, interval_s=bad)
