"""The series one transfer path or lock holder records, and one call per transition that records them.

`PathMetrics.finished(...)` records a transfer's end (outcome count, duration, lock wait and hold, blocks and
bytes) in one call; `HolderMetrics` records a lock holder that is not a transfer (the forward pass) under
`path=holder`, beside the transfers' own. These classes write straight to the children (prometheus_client's
in multiprocess mode); buffered.py has the single-process versions, which batch per thread.
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Any

from kvobs import semconv as sc
from kvobs.telemetry._metrics.accumulators import ExemplarSource
from kvobs.telemetry._metrics.families import Failed, MetricFamilies

__all__ = ["HolderMetrics", "InFlight", "LockSeries", "PathMetrics"]


class InFlight:
    """Transfers running now. A deque's append and pop are atomic and need no lock, unlike a Gauge update;
    the gauge reads `len()` at scrape time instead."""

    def __init__(self) -> None:
        running: deque[None] = deque()
        self.start = functools.partial(running.append, None)
        self.finish = running.pop
        self.count = running.__len__


class LockSeries:
    """Lock wait, hold, timeouts and conflicts of one (engine, lock, path or holder)."""

    def __init__(self, families: MetricFamilies, engine: str, lock_name: str, name: str, failed: Failed) -> None:
        self.lock_wait = families.lock_wait.labels(engine, lock_name, name)
        self.lock_hold = families.lock_hold.labels(engine, lock_name, name)
        self.lock_timeouts = families.lock_timeouts.labels(engine, lock_name, name)
        self._conflicts_family = families.lock_conflicts
        self._conflict_labels = (engine, lock_name, name)
        self._conflicts: dict[str, Any] = {}
        self._exemplars = not families.multiprocess  # prometheus_client keeps no exemplars across processes
        self._failed = failed

    def conflicted(self, holder_path: str) -> None:
        """The lock was found held by `holder_path` (a transfer path, or a holder such as `forward`)."""
        counter = self._conflicts.get(holder_path)
        if counter is None:
            counter = self._conflicts[holder_path] = self._conflicts_family.labels(*self._conflict_labels,
                                                                                   holder_path)
        counter.inc()

    def timed_out(self, waited_s: float, exemplar: ExemplarSource | None = None) -> None:
        """The lock was not acquired within `waited_s` (`exemplar` goes on the wait)."""
        self.lock_timeouts.inc()
        self._observe(self.lock_wait, waited_s, exemplar)

    def _observe(self, child: Any, amount: float, exemplar: ExemplarSource | None) -> None:
        if exemplar and self._exemplars:
            child.observe(amount, exemplar)
        else:
            child.observe(amount)


class PathMetrics(LockSeries):
    """The series of one (engine, lock, path). The children stay available as attributes
    (`transfers[outcome]`, `duration[outcome]`, `lock_wait`, ...)."""

    def __init__(self, families: MetricFamilies, engine: str, lock_name: str, path: str, failed: Failed) -> None:
        super().__init__(families, engine, lock_name, path, failed)
        f = families
        self.path = path
        self.transfers = {o: f.transfers.labels(engine, path, o) for o in sc.TRANSFER_OUTCOMES}
        self.duration = {o: f.duration.labels(engine, path, o) for o in sc.TRANSFER_OUTCOMES}
        self.blocks = f.blocks.labels(engine, path)
        self.bytes = f.bytes.labels(engine, path)
        self.in_flight = InFlight()
        self.nan_checks = {r: f.nan_checks.labels(engine, path, r) for r in sc.CHECK_RESULTS}
        self.nan_blocks = f.nan_blocks.labels(engine, path)

    def finished(self, outcome: str, duration_s: float, wait_s: float, hold_s: float, blocks: int, nbytes: int,
                 exemplar: ExemplarSource | None = None) -> None:
        """One transfer ended with `outcome`: counted, its duration, lock wait and hold observed (`exemplar`,
        `{trace_id, span_id}` or None, on the duration and the wait), and for `ok` its blocks and bytes added."""
        self.transfers[outcome].inc()
        self._observe(self.duration[outcome], duration_s, exemplar)
        self._observe(self.lock_wait, wait_s, exemplar)
        self.lock_hold.observe(hold_s)
        if outcome == sc.OUTCOME_OK:
            if blocks:
                self.blocks.inc(blocks)
            if nbytes:
                self.bytes.inc(nbytes)

    def finished_many(self, outcome: str, duration_s: float, wait_s: float, hold_s: float,
                      moved: list[tuple[Any, int, int]], exemplar: ExemplarSource | None = None) -> None:
        """A batch: one finished transfer per (request id, blocks, bytes) of `moved`, sharing the timings."""
        for _, blocks, nbytes in moved:
            self.finished(outcome, duration_s, wait_s, hold_s, blocks, nbytes, exemplar)

    def timed_out(self, waited_s: float, exemplar: ExemplarSource | None = None) -> None:
        """The lock was not acquired within `waited_s`: a lock timeout and a transfer with outcome `timeout`."""
        super().timed_out(waited_s, exemplar)
        self.transfers[sc.OUTCOME_TIMEOUT].inc()
        self._observe(self.duration[sc.OUTCOME_TIMEOUT], waited_s, exemplar)

    def rejected(self) -> None:
        """Refused before the lock was touched."""
        self.transfers[sc.OUTCOME_REJECTED].inc()

    def checked(self, result: str, bad_blocks: int) -> None:
        """One NaN/Inf check with `result` (clean, nan, inf) that found `bad_blocks` bad blocks."""
        self.nan_checks[result].inc()
        if bad_blocks:
            self.nan_blocks.inc(bad_blocks)


class HolderMetrics(LockSeries):
    """Lock wait, hold, timeouts and conflicts of a lock holder that is not a transfer (the forward pass)."""

    def __init__(self, families: MetricFamilies, engine: str, lock_name: str, holder: str, failed: Failed) -> None:
        super().__init__(families, engine, lock_name, holder, failed)
        self.holder = holder

    def held(self, wait_s: float, hold_s: float, exemplar: ExemplarSource | None = None) -> None:
        """The holder waited `wait_s` for the lock and held it `hold_s` (`exemplar` goes on the wait)."""
        self._observe(self.lock_wait, wait_s, exemplar)
        self.lock_hold.observe(hold_s)
