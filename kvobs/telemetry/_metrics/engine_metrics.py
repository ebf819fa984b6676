"""The metrics one observer records: its paths, lock holders and signals, and its scrape-time gauges.

Counters and histograms stay with the registry's families, so a new observer with the same engine label
continues them. Scrape-time gauges are owned here and bound to an owner held weakly (`bind_lock_held(owner,
read)`), so they never keep an observer or a signal buffer alive, and read 0 once the owner is gone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from kvobs import semconv as sc
from kvobs.telemetry._failures import STAGE_SCRAPE, TELEMETRY_STAGES, TelemetryFailures
from kvobs.telemetry._metrics.accumulators import GaugeCell, GaugeFamily
from kvobs.telemetry._metrics.buffered import BufferedHolderMetrics, BufferedPathMetrics
from kvobs.telemetry._metrics.families import MetricFamilies, MultiprocessGaugeFamily
from kvobs.telemetry._metrics.path_metrics import HolderMetrics, InFlight, PathMetrics

__all__ = ["EngineMetrics"]


class EngineMetrics:
    """What one observer records. One live EngineMetrics per engine label per registry (DuplicateEngine
    otherwise); `path(name)` and `holder(name)` give the recording objects of a path or a lock holder."""

    def __init__(self, families: MetricFamilies, engine: str, lock_name: str, *, logger: Any = None) -> None:
        families.claim_engine(engine, self)
        f = families
        self.families = families
        self.engine = engine
        self.lock_name = lock_name
        self.telemetry_errors = {s: f.telemetry_errors.labels(engine, s) for s in TELEMETRY_STAGES}
        self.failures = TelemetryFailures(engine, self.telemetry_errors, logger)
        self._scrape_failed = functools.partial(self.failures, STAGE_SCRAPE)
        self.paths: dict[str, PathMetrics] = {}
        self._open: dict[str, tuple[GaugeCell, GaugeCell]] = {}
        self._holders: dict[str, HolderMetrics] = {}
        for path in sc.PATHS:
            self.path(path)
        self.lock_held = self._gauge(f.lock_held, engine, lock_name)
        self.blocks_claimed = {m: self._gauge(f.blocks_claimed, engine, lock_name, m) for m in sc.CLAIM_MODES}
        self.pending = self._gauge(f.pending, engine)
        self.oldest_age = self._gauge(f.oldest_age, engine)
        self.signals = {o: f.signals.labels(engine, o) for o in sc.SIGNAL_OUTCOMES}
        self.signal_buffered = f.signal_buffered.labels(engine)

    def _gauge(self, family: GaugeFamily, *labelvalues: str) -> GaugeCell:
        cell = family.labels(*labelvalues)
        if isinstance(family, MultiprocessGaugeFamily):
            family.watch(cell, labelvalues, self.failures)
        return cell

    def path(self, name: str) -> PathMetrics:
        """The PathMetrics of path `name`, created on first use (extra paths beside prefetch, write_back, send)."""
        found = self.paths.get(name)
        if found is None:
            f = self.families
            kind = PathMetrics if f.multiprocess else BufferedPathMetrics
            found = self.paths[name] = self._shared(kind, "path", name)
            in_flight = self._gauge(f.in_flight, self.engine, name)
            in_flight.bind(found.in_flight, _running_count, self._scrape_failed)
            self._open[name] = (in_flight, self._gauge(f.oldest_open_age, self.engine, name))
        return found

    def holder(self, name: str) -> HolderMetrics:
        """The HolderMetrics of lock holder `name` (e.g. `forward`), created on first use."""
        found = self._holders.get(name)
        if found is None:
            kind = HolderMetrics if self.families.multiprocess else BufferedHolderMetrics
            found = self._holders[name] = self._shared(kind, "holder", name)
        return found

    def _shared(self, kind: type[Any], role: str, name: str) -> Any:
        """The families' recording object of this engine, lock and path or holder `name`."""
        f = self.families
        engine = self.engine
        lock_name = self.lock_name
        return f.shared((role, engine, lock_name, name), lambda: kind(f, engine, lock_name, name, self.failures))

    # -- scrape-time gauges, read from owners held weakly (0 once an owner is gone) -------------------------

    def bind_open_transfers(self, path: str, owner: Any, count: Callable[[Any], float],
                            oldest_age: Callable[[Any], float]) -> None:
        """kvobs_transfers_in_flight and kvobs_transfer_oldest_open_age_seconds of `path` read `count(owner)`
        and `oldest_age(owner)` at scrape time."""
        self.path(path)
        in_flight, oldest = self._open[path]
        in_flight.bind(owner, count, self._scrape_failed)
        oldest.bind(owner, oldest_age, self._scrape_failed)

    def bind_lock_held(self, owner: Any, read: Callable[[Any], float]) -> None:
        """kvobs_lock_held_seconds reads `read(owner)` at scrape time."""
        self.lock_held.bind(owner, read, self._scrape_failed)

    def bind_blocks_claimed(self, mode: str, owner: Any, read: Callable[[Any], float]) -> None:
        """kvobs_lock_blocks_claimed{mode} reads `read(owner)` at scrape time."""
        if mode not in self.blocks_claimed:
            raise ValueError(f"unknown claim mode {mode!r}; known modes: {', '.join(self.blocks_claimed)}")
        self.blocks_claimed[mode].bind(owner, read, self._scrape_failed)

    def bind_pending_signals(self, owner: Any, count: Callable[[Any], float],
                             oldest_age: Callable[[Any], float]) -> None:
        """kvobs_pending_signals and kvobs_pending_signal_oldest_age_seconds read `count(owner)` and
        `oldest_age(owner)` at scrape time."""
        self.pending.bind(owner, count, self._scrape_failed)
        self.oldest_age.bind(owner, oldest_age, self._scrape_failed)

    def count_telemetry_error(self, stage: str, error: BaseException | None = None, *,
                              where: str | None = None) -> None:
        """Count a swallowed telemetry failure and log its kind once per interval; never raises. Inside an
        `except` block the exception being handled is the one logged."""
        self.failures(stage, error, where=where)


def _running_count(in_flight: InFlight) -> int:
    return in_flight.count()
