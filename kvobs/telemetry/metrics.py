"""kvobs's Prometheus metrics: one set of families per registry, and one call per transition that records.

`EngineMetrics` is what an observer holds; `path(name)` gives a `PathMetrics` whose `finished(...)` records a
transfer (outcome count, duration, lock wait and hold, blocks and bytes) in one call, and `holder(name)` a
`HolderMetrics` for lock holders that are not transfers (the forward pass). Scrape-time gauges are bound to
an owner held weakly (`bind_lock_held(owner, read)`), so they never keep an observer or a buffer alive.

In a single process the families are plain accumulators exposed by one collector (accumulators.py), and
`finished` appends to a per-thread buffer folded in by batches (buffers.py): exposition is identical to
prometheus_client's own families. Under PROMETHEUS_MULTIPROC_DIR the children are prometheus_client's (their
values live in per-process files the scraping process reads), every call updates them directly, and a
thread copies scrape-time gauges into the files (refresher.py).

All families are one collector registered in one step, so a registry holding a conflicting name gets none
of them; one live observer per engine label per registry, so two never share (and hide) each other's series.
"""

from __future__ import annotations

import functools
import gc
import operator
import os
import threading
import time
import weakref
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import compress
from typing import Any, ClassVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Exemplar

from kvobs import semconv as sc
from kvobs.telemetry.accumulators import (
    CounterCell,
    CounterFamily,
    GaugeCell,
    GaugeFamily,
    HistogramCell,
    HistogramFamily,
)
from kvobs.telemetry.buffers import ThreadBuffers
from kvobs.errors import DuplicateEngine, MetricNameConflict
from kvobs.telemetry.failures import STAGE_EXPORT, STAGE_METRICS, STAGE_SCRAPE, TELEMETRY_STAGES, TelemetryFailures
from kvobs.telemetry.multiprocess import check_multiprocess_dir, multiprocess_enabled
from kvobs.telemetry.refresher import Refresher

__all__ = [
    "TELEMETRY_STAGES", "EngineMetrics", "HolderMetrics", "InFlight", "MetricFamilies", "PathMetrics",
    "bind_scrape_time", "multiprocess_enabled", "observe", "process_failures",
]

Failed = Callable[[str, BaseException], None]

_TELEMETRY_ERRORS_HELP = "Telemetry failures swallowed so the engine call is unaffected."

# attribute, metric name, kind, help, multiprocess mode of a gauge
_SPECS: tuple[tuple[str, str, str, str, str], ...] = (
    ("transfers", sc.TRANSFERS_TOTAL, "counter", "Guarded KV transfers by outcome.", ""),
    ("duration", sc.TRANSFER_DURATION_SECONDS, "histogram", "Wall time of a guarded transfer call.", ""),
    ("blocks", sc.TRANSFER_BLOCKS_TOTAL, "counter", "KV blocks moved by guarded transfers.", ""),
    ("bytes", sc.TRANSFER_BYTES_TOTAL, "counter", "Bytes moved by guarded transfers.", ""),
    ("in_flight", sc.TRANSFERS_IN_FLIGHT, "gauge", "Guarded transfers running now.", "livesum"),
    ("oldest_open_age", sc.TRANSFER_OLDEST_OPEN_AGE_SECONDS, "gauge",
     "Age of the oldest guarded transfer still open; 0 when none.", "livemax"),
    ("lock_wait", sc.LOCK_WAIT_SECONDS, "histogram", "Time spent waiting for the cache lock.", ""),
    ("lock_hold", sc.LOCK_HOLD_SECONDS, "histogram", "Time the cache lock was held per transfer.", ""),
    ("lock_timeouts", sc.LOCK_TIMEOUTS_TOTAL, "counter", "Cache lock acquisitions that timed out.", ""),
    ("lock_conflicts", sc.LOCK_CONFLICTS_TOTAL, "counter",
     "Cache lock acquisitions that found the lock held, by the holder's path.", ""),
    ("lock_held", sc.LOCK_HELD_SECONDS, "gauge", "How long the current holder has held the lock; 0 when free.",
     "livemax"),
    ("blocks_claimed", sc.LOCK_BLOCKS_CLAIMED, "gauge", "KV blocks claimed on the cache lock now, by claim mode.",
     "livesum"),
    ("nan_checks", sc.NAN_CHECKS_TOTAL, "counter", "NaN/Inf checks of transferred KV blocks by result.", ""),
    ("nan_blocks", sc.NAN_BLOCKS_TOTAL, "counter", "KV blocks found holding NaN or Inf.", ""),
    ("pending", sc.PENDING_SIGNALS, "gauge", "Early layer0 signals waiting for their task.", "livesum"),
    ("oldest_age", sc.PENDING_SIGNAL_OLDEST_AGE_SECONDS, "gauge",
     "Age of the oldest pending early signal; 0 when none.", "livemax"),
    ("signals", sc.SIGNALS_TOTAL, "counter", "Layer0 signal decisions by outcome.", ""),
    ("signal_buffered", sc.SIGNAL_BUFFERED_SECONDS, "histogram",
     "Time an early signal waited before it was recovered.", ""),
    ("build_info", sc.BUILD_INFO, "gauge", "kvobs version, always 1.", "max"),
    ("telemetry_errors", sc.TELEMETRY_ERRORS_TOTAL, "counter", _TELEMETRY_ERRORS_HELP, ""),
)


class MultiprocessGaugeFamily(GaugeFamily):
    """A gauge family whose cells are copied into a prometheus_client multiprocess gauge by the refresher."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...], mode: str) -> None:
        super().__init__(name, documentation, labelnames)
        self.gauge = Gauge(name, documentation, labelnames, registry=None, multiprocess_mode=mode)
        self._watched: weakref.WeakSet[GaugeCell] = weakref.WeakSet()

    def watch(self, cell: GaugeCell, labelvalues: tuple[str, ...], failed: Failed) -> None:
        if cell not in self._watched:
            self._watched.add(cell)
            Refresher.shared().watch(cell, self.gauge.labels(*labelvalues), failed)

    def describe(self) -> list[Metric]:
        return list(self.gauge.describe())

    def collect(self) -> list[Metric]:
        return list(self.gauge.collect())


class MetricFamilies:
    """Every kvobs metric family of one registry, registered as one collector. Shared by every observer of
    that registry; `MetricFamilies.of(registry)` finds or creates it."""

    _by_registry: ClassVar[weakref.WeakKeyDictionary[CollectorRegistry, MetricFamilies]] = (
        weakref.WeakKeyDictionary())
    _live: ClassVar[weakref.WeakSet[MetricFamilies]] = weakref.WeakSet()
    _create_lock = threading.Lock()

    def __init__(self, registry: CollectorRegistry, buckets: tuple[float, ...]) -> None:
        self._registry = weakref.ref(registry)
        self.buckets = buckets
        self.multiprocess = multiprocess_enabled()
        if self.multiprocess:
            check_multiprocess_dir()
        self.lock = threading.Lock()  # every accumulator and buffer; drains and scrapes take it
        self.failure_lock = threading.Lock()  # the telemetry-error counters, counted from inside drains
        self.ordered: list[Any] = []
        for attribute, name, kind, documentation, mode in _SPECS:
            family = self._family(name, kind, documentation, mode)
            setattr(self, attribute, family)
            self.ordered.append(family)
        self._paths: dict[tuple[str, str, str], PathMetrics] = {}
        self._holders: dict[tuple[str, str, str], HolderMetrics] = {}
        self._buffers: list[ThreadBuffers] = []
        self._engines: weakref.WeakValueDictionary[str, EngineMetrics] = weakref.WeakValueDictionary()
        self._structure_lock = threading.Lock()
        try:
            registry.register(_Collector(self))
        except ValueError as exc:
            raise MetricNameConflict(str(exc)) from None
        from kvobs import __version__

        self._build_info = self.build_info.labels(__version__)  # held here: gauge families hold cells weakly
        self._build_info.set(1)
        if isinstance(self.build_info, MultiprocessGaugeFamily):
            self.build_info.gauge.labels(__version__).set(1)
        _show_process_failures(self)
        MetricFamilies._live.add(self)

    def _family(self, name: str, kind: str, documentation: str, mode: str) -> Any:
        labelnames = sc.METRIC_LABELS[name]
        if self.multiprocess:
            if kind == "counter":
                return Counter(name.removesuffix("_total"), documentation, labelnames, registry=None)
            if kind == "histogram":
                return Histogram(name, documentation, labelnames, buckets=self.buckets, registry=None)
            return MultiprocessGaugeFamily(name, documentation, labelnames, mode)
        if kind == "counter":
            lock = self.failure_lock if name == sc.TELEMETRY_ERRORS_TOTAL else self.lock
            return CounterFamily(name, documentation, labelnames, lock)
        if kind == "histogram":
            return HistogramFamily(name, documentation, labelnames, self.buckets, self.lock)
        return GaugeFamily(name, documentation, labelnames)

    @property
    def registry(self) -> CollectorRegistry | None:
        return self._registry()

    @classmethod
    def of(cls, registry: CollectorRegistry | None, buckets: Iterable[float] | None = None) -> MetricFamilies:
        """The families of `registry` (default: prometheus_client's global REGISTRY), created on first use."""
        registry = REGISTRY if registry is None else registry
        wanted = tuple(buckets) if buckets is not None else None
        with cls._create_lock:
            families = cls._by_registry.get(registry)
            if families is None:
                families = cls(registry, wanted or sc.DEFAULT_LATENCY_BUCKETS)
                cls._by_registry[registry] = families
            elif wanted is not None and wanted != families.buckets:
                raise ValueError(
                    f"histogram buckets {wanted} differ from {families.buckets} already registered on this "
                    "registry; use one bucket layout per registry"
                )
            return families

    # -- what observers share -------------------------------------------------------------------------------

    def claim_engine(self, engine: str, metrics: EngineMetrics) -> None:
        """Let `metrics` use the engine label, unless a live EngineMetrics already does (DuplicateEngine)."""
        for generation in (0, 1, 2, None):
            with self._structure_lock:
                if self._engines.get(engine) in (None, metrics):
                    self._engines[engine] = metrics
                    return
            if generation is not None:
                gc.collect(generation)  # an observer the engine dropped may wait in a cycle: youngest first
        raise DuplicateEngine(engine)

    def path_metrics(self, engine: str, lock_name: str, path: str, failed: Failed) -> PathMetrics:
        """The PathMetrics of (engine, lock, path): kept with the families, so counts continue across observers."""
        key = (engine, lock_name, path)
        with self._structure_lock:
            found = self._paths.get(key)
            if found is None:
                kind = PathMetrics if self.multiprocess else BufferedPathMetrics
                found = self._paths[key] = kind(self, engine, lock_name, path, failed)
            return found

    def holder_metrics(self, engine: str, lock_name: str, holder: str, failed: Failed) -> HolderMetrics:
        key = (engine, lock_name, holder)
        with self._structure_lock:
            found = self._holders.get(key)
            if found is None:
                kind = HolderMetrics if self.multiprocess else BufferedHolderMetrics
                found = self._holders[key] = kind(self, engine, lock_name, holder, failed)
            return found

    def add_buffers(self, buffers: ThreadBuffers) -> None:
        with self.lock:
            self._buffers.append(buffers)

    def drain_locked(self) -> None:
        """Fold every buffered record in; the caller holds `lock`."""
        for buffers in self._buffers:
            buffers.drain_all_locked()

    def _after_fork_in_child(self) -> None:
        """Locks another thread held at the fork would stay held in the child: replace them all."""
        self.lock = threading.Lock()
        self.failure_lock = threading.Lock()
        self._structure_lock = threading.Lock()
        for family in self.ordered:
            if hasattr(family, "_children_lock"):
                family._children_lock = threading.Lock()
            if isinstance(family, (CounterFamily, HistogramFamily)):
                family.lock = self.failure_lock if family is self.telemetry_errors else self.lock
                for cell in family.children.values():
                    if cell is not _process_export_cell():
                        cell.lock = family.lock
        for buffers in self._buffers:
            buffers.lock = self.lock


class _Collector:
    """The one collector of a registry's kvobs families. A scrape first folds in every buffered record."""

    def __init__(self, families: MetricFamilies) -> None:
        self._families = families

    def describe(self) -> Iterator[Metric]:
        for family in self._families.ordered:
            yield from family.describe()

    def collect(self) -> Iterator[Metric]:
        families = self._families
        if families.multiprocess:
            for family in families.ordered:
                yield from family.collect()
            return
        # Gauges first, outside the lock: their readers take their owners' locks, and what a reader flushes
        # into a counter as it is read (a signal buffer's tally) belongs in this same scrape.
        gauges = {id(f): f.collect() for f in families.ordered if isinstance(f, GaugeFamily)}
        with families.lock:
            families.drain_locked()
            snapshot = [gauges[id(f)] if id(f) in gauges else f.collect() for f in families.ordered]
        for collected in snapshot:
            yield from collected


class InFlight:
    """Transfers running now. A deque's append and pop are atomic and far cheaper than a locked Gauge update;
    the gauge reads `len()` at scrape time instead."""

    def __init__(self) -> None:
        running: deque[None] = deque()
        self.start = functools.partial(running.append, None)
        self.finish = running.pop
        self.count = running.__len__


class PathMetrics:
    """The series of one (engine, lock, path), and one call per transition that records them.

    Every call goes straight to the children: prometheus_client's in multiprocess mode. The children stay
    available as attributes (`transfers[outcome]`, `duration[outcome]`, `lock_wait`, ...).
    """

    def __init__(self, families: MetricFamilies, engine: str, lock_name: str, path: str, failed: Failed) -> None:
        f = families
        self.path = path
        self.transfers = {o: f.transfers.labels(engine, path, o) for o in sc.TRANSFER_OUTCOMES}
        self.duration = {o: f.duration.labels(engine, path, o) for o in sc.TRANSFER_OUTCOMES}
        self.blocks = f.blocks.labels(engine, path)
        self.bytes = f.bytes.labels(engine, path)
        self.in_flight = InFlight()
        self.lock_wait = f.lock_wait.labels(engine, lock_name, path)
        self.lock_hold = f.lock_hold.labels(engine, lock_name, path)
        self.lock_timeouts = f.lock_timeouts.labels(engine, lock_name, path)
        self.nan_checks = {r: f.nan_checks.labels(engine, path, r) for r in sc.CHECK_RESULTS}
        self.nan_blocks = f.nan_blocks.labels(engine, path)
        self._conflicts_family = f.lock_conflicts
        self._conflict_labels = (engine, lock_name, path)
        self._conflicts: dict[str, Any] = {}
        self._exemplars = not f.multiprocess  # prometheus_client keeps no exemplars across processes
        self._failed = failed

    def finished(self, outcome: str, duration_s: float, wait_s: float, hold_s: float, blocks: int, nbytes: int,
                 exemplar: dict[str, str] | None = None) -> None:
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
                      moved: list[tuple[Any, int, int]], exemplar: dict[str, str] | None = None) -> None:
        """A batch: one finished transfer per (request id, blocks, bytes) of `moved`, sharing the timings."""
        for _, blocks, nbytes in moved:
            self.finished(outcome, duration_s, wait_s, hold_s, blocks, nbytes, exemplar)

    def timed_out(self, waited_s: float, exemplar: dict[str, str] | None = None) -> None:
        """The lock was not acquired within `waited_s`: a lock timeout and a transfer with outcome `timeout`."""
        self.lock_timeouts.inc()
        self._observe(self.lock_wait, waited_s, exemplar)
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

    def conflicted(self, holder_path: str) -> None:
        """The lock was found held by `holder_path` (a path or a holder such as `forward`)."""
        counter = self._conflicts.get(holder_path)
        if counter is None:
            counter = self._conflicts[holder_path] = self._conflicts_family.labels(*self._conflict_labels,
                                                                                   holder_path)
        counter.inc()

    def _observe(self, child: Any, amount: float, exemplar: dict[str, str] | None) -> None:
        if exemplar and self._exemplars:
            child.observe(amount, exemplar)
        else:
            child.observe(amount)


class BufferedPathMetrics(PathMetrics):
    """Single-process PathMetrics: `finished` adds one record to the calling thread's buffer; batches are
    folded into the accumulators when a buffer is full and at every scrape."""

    def __init__(self, families: MetricFamilies, engine: str, lock_name: str, path: str, failed: Failed) -> None:
        super().__init__(families, engine, lock_name, path, failed)
        self._buffers = ThreadBuffers(_TRANSFER_WIDTH, self._apply, families.lock)
        self._local = self._buffers.local
        self._full = self._buffers.full
        families.add_buffers(self._buffers)

    def finished(self, outcome: str, duration_s: float, wait_s: float, hold_s: float, blocks: int, nbytes: int,
                 exemplar: dict[str, str] | None = None) -> None:
        try:
            values = self._local.values
        except AttributeError:
            values = self._buffers.new_buffer()
        values.extend((outcome, duration_s, wait_s, hold_s, blocks, nbytes, exemplar and (exemplar, _now())))
        if len(values) >= self._full:
            self._buffers.drain(values)

    def finished_many(self, outcome: str, duration_s: float, wait_s: float, hold_s: float,
                      moved: list[tuple[Any, int, int]], exemplar: dict[str, str] | None = None) -> None:
        try:
            values = self._local.values
        except AttributeError:
            values = self._buffers.new_buffer()
        records = [outcome, duration_s, wait_s, hold_s, 0, 0, exemplar and (exemplar, _now())] * len(moved)
        records[4::_TRANSFER_WIDTH] = map(_SECOND, moved)  # blocks, then bytes, filled in C
        records[5::_TRANSFER_WIDTH] = map(_THIRD, moved)
        values += records
        if len(values) >= self._full:
            self._buffers.drain(values)

    def _apply(self, values: list[Any]) -> None:
        """Fold a batch in (under the families' lock). A batch that cannot be folded as a whole is folded one
        record at a time; a record that cannot be is counted and dropped, never the batch."""
        _apply_or_split(self._prepare, values, _TRANSFER_WIDTH, self._failed)

    def _prepare(self, values: list[Any]) -> _Prepared:
        """Fields of the flat records (outcome, duration, wait, hold, blocks, bytes, exemplar) by slicing."""
        w = _TRANSFER_WIDTH
        outcomes = values[0::w]
        count = len(outcomes)
        batches = [self.lock_wait.prepare(values[2::w]), self.lock_hold.prepare(values[3::w])]
        if outcomes.count(sc.OUTCOME_OK) == count:
            batches.append(self.duration[sc.OUTCOME_OK].prepare(values[1::w]))
            moved_blocks, moved_bytes = _total(values[4::w]), _total(values[5::w])
            increments = [(self.transfers[sc.OUTCOME_OK], count)]
        else:
            by_outcome: dict[str, list[float]] = {}
            for outcome, duration in zip(outcomes, values[1::w]):
                by_outcome.setdefault(outcome, []).append(duration)
            increments = []
            for outcome, durations in by_outcome.items():
                batches.append(self.duration[outcome].prepare(durations))
                increments.append((self.transfers[outcome], len(durations)))
            ok = [outcome == sc.OUTCOME_OK for outcome in outcomes]
            moved_blocks = _total(list(compress(values[4::w], ok)))
            moved_bytes = _total(list(compress(values[5::w], ok)))
        increments += [(self.blocks, moved_blocks), (self.bytes, moved_bytes)]
        marks = []
        exemplars = values[6::w]
        if exemplars.count(None) != count:
            for outcome, duration, wait, exemplar in zip(outcomes, values[1::w], values[2::w], exemplars):
                if exemplar:
                    labels, timestamp = exemplar
                    marks.append((self.lock_wait, wait, labels, timestamp))
                    marks.append((self.duration[outcome], duration, labels, timestamp))
        return batches, increments, marks


class HolderMetrics:
    """Lock wait, hold and timeouts of a lock holder that is not a transfer (the forward pass), under
    `path=holder` beside the transfers' own."""

    def __init__(self, families: MetricFamilies, engine: str, lock_name: str, holder: str, failed: Failed) -> None:
        self.holder = holder
        self.lock_wait = families.lock_wait.labels(engine, lock_name, holder)
        self.lock_hold = families.lock_hold.labels(engine, lock_name, holder)
        self.lock_timeouts = families.lock_timeouts.labels(engine, lock_name, holder)
        self._conflicts_family = families.lock_conflicts
        self._conflict_labels = (engine, lock_name, holder)
        self._conflicts: dict[str, Any] = {}
        self._exemplars = not families.multiprocess
        self._failed = failed

    def held(self, wait_s: float, hold_s: float, exemplar: dict[str, str] | None = None) -> None:
        """The holder waited `wait_s` for the lock and held it `hold_s` (`exemplar` goes on the wait)."""
        if exemplar and self._exemplars:
            self.lock_wait.observe(wait_s, exemplar)
        else:
            self.lock_wait.observe(wait_s)
        self.lock_hold.observe(hold_s)

    def conflicted(self, holder_path: str) -> None:
        """The holder had to wait for `holder_path` (a transfer path, or another holder)."""
        counter = self._conflicts.get(holder_path)
        if counter is None:
            counter = self._conflicts[holder_path] = self._conflicts_family.labels(*self._conflict_labels,
                                                                                   holder_path)
        counter.inc()

    def timed_out(self, waited_s: float, exemplar: dict[str, str] | None = None) -> None:
        """The holder gave up after `waited_s` (`exemplar` goes on the wait)."""
        self.lock_timeouts.inc()
        if exemplar and self._exemplars:
            self.lock_wait.observe(waited_s, exemplar)
        else:
            self.lock_wait.observe(waited_s)


class BufferedHolderMetrics(HolderMetrics):
    """Single-process HolderMetrics: `held` adds to the calling thread's buffer, like BufferedPathMetrics."""

    def __init__(self, families: MetricFamilies, engine: str, lock_name: str, holder: str, failed: Failed) -> None:
        super().__init__(families, engine, lock_name, holder, failed)
        self._buffers = ThreadBuffers(_HOLDER_WIDTH, self._apply, families.lock)
        self._local = self._buffers.local
        self._full = self._buffers.full
        families.add_buffers(self._buffers)

    def held(self, wait_s: float, hold_s: float, exemplar: dict[str, str] | None = None) -> None:
        try:
            values = self._local.values
        except AttributeError:
            values = self._buffers.new_buffer()
        values.extend((wait_s, hold_s, exemplar and (exemplar, _now())))
        if len(values) >= self._full:
            self._buffers.drain(values)

    def _apply(self, values: list[Any]) -> None:
        _apply_or_split(self._prepare, values, _HOLDER_WIDTH, self._failed)

    def _prepare(self, values: list[Any]) -> _Prepared:
        """Fields of the flat records (wait, hold, exemplar) by slicing."""
        marks = [(self.lock_wait, wait, *exemplar) for wait, exemplar in zip(values[0::3], values[2::3]) if exemplar]
        return [self.lock_wait.prepare(values[0::3]), self.lock_hold.prepare(values[1::3])], [], marks


_SECOND, _THIRD = operator.itemgetter(1), operator.itemgetter(2)
_TRANSFER_WIDTH = 7  # outcome, duration, wait, hold, blocks, bytes, (exemplar, time) or None
_HOLDER_WIDTH = 3  # wait, hold, (exemplar, time) or None
_now = time.time
_Prepared = tuple[list[Any], list[tuple[CounterCell, float]], list[tuple[HistogramCell, float, dict[str, str], float]]]


def _apply_or_split(prepare: Callable[[list[Any]], _Prepared], values: list[Any], width: int,
                    failed: Failed) -> None:
    """Fold a batch in whole; if it cannot be, fold its records one at a time, counting each that cannot."""
    try:
        _commit(prepare(values))
    except Exception:  # noqa: BLE001 - a bad record must not cost the others
        for start in range(0, len(values), width):
            try:
                _commit(prepare(values[start:start + width]))
            except Exception as exc:  # noqa: BLE001
                failed(STAGE_METRICS, exc)


def _total(amounts: list[Any]) -> int:
    """The sum of per-record counts, refusing a negative one (a counter never goes down)."""
    if amounts and min(amounts) < 0:
        raise ValueError(f"negative count among {amounts[:8]}: counters never go down")
    return sum(amounts)


def _commit(prepared: _Prepared) -> None:
    """Apply a prepared batch; nothing here can fail, so a batch is applied whole or not at all."""
    batches, increments, marks = prepared
    for cell, total, bucket_increments in batches:
        cell.commit(total, bucket_increments)
    for counter, amount in increments:
        counter.value += amount
    for histogram, amount, labels, timestamp in marks:
        histogram.set_exemplar(amount, labels, timestamp)


class EngineMetrics:
    """The metrics one observer records: its paths, lock holders, signals and scrape-time gauges.

    One live EngineMetrics per engine label per registry (DuplicateEngine otherwise). Scrape-time gauges are
    owned here and read their owners weakly; counters and histograms stay with the families, so a new
    observer with the same label continues them.
    """

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
            found = self.paths[name] = f.path_metrics(self.engine, self.lock_name, name, self.failures)
            in_flight = self._gauge(f.in_flight, self.engine, name)
            in_flight.bind(found.in_flight, _running_count, self._scrape_failed)
            self._open[name] = (in_flight, self._gauge(f.oldest_open_age, self.engine, name))
        return found

    add_path = path

    def holder(self, name: str) -> HolderMetrics:
        """The HolderMetrics of lock holder `name` (e.g. `forward`), created on first use."""
        found = self._holders.get(name)
        if found is None:
            found = self._holders[name] = self.families.holder_metrics(self.engine, self.lock_name, name,
                                                                       self.failures)
        return found

    def lock_children(self, holder: str) -> tuple[Any, Any, Any]:
        """Lock wait, hold and timeout children of a holder that is not a transfer path."""
        h = self.holder(holder)
        return h.lock_wait, h.lock_hold, h.lock_timeouts

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

    def count_telemetry_error(self, stage: str, error: BaseException | None = None) -> None:
        """Count a swallowed telemetry failure and log its kind once per interval; never raises. Inside an
        `except` block the exception being handled is the one logged."""
        self.failures(stage, error)


def _running_count(in_flight: InFlight) -> int:
    return in_flight.count()


def observe(child: Any, amount: float, exemplar: dict[str, str] | None) -> None:
    """`child.observe(amount, exemplar)`; for a prometheus_client child, without its per-call exemplar
    validation (kvobs's exemplar labels, trace_id and span_id, are valid by construction)."""
    if exemplar is None or isinstance(child, HistogramCell):
        child.observe(amount, exemplar)
        return
    buckets = getattr(child, "_buckets", None)
    bounds = getattr(child, "_upper_bounds", None)
    if buckets is None or bounds is None:
        child.observe(amount, exemplar)
        return
    child.observe(amount)
    buckets[bisect_left(bounds, amount)].set_exemplar(Exemplar(exemplar, amount, time.time()))


_unowned_cells: list[GaugeCell] = []  # scrape-time prometheus_client children bound through bind_scrape_time


def bind_scrape_time(gauge_child: Any, read: Callable[[], float], on_error: Callable[[], None]) -> None:
    """Make `gauge_child` show `read()` as of scrape time, holding `read` strongly (prefer the EngineMetrics
    `bind_*` methods, which hold their owner weakly). A `read` that raises shows 0 and calls `on_error`."""
    if isinstance(gauge_child, GaugeCell):
        gauge_child.set_function(read, on_error)
        return
    cell = GaugeCell()
    cell.set_function(read, on_error)
    if multiprocess_enabled():
        _unowned_cells.append(cell)
        Refresher.shared().watch(cell, gauge_child, lambda stage, exc: on_error())
    else:
        gauge_child.set_function(cell.get)


# -- failures that belong to the process, not to one observer (span export): engine label "" --------------

_process_lock = threading.Lock()
_process_state: dict[str, Any] = {}


def process_failures() -> TelemetryFailures:
    """The reporter of process-wide telemetry failures (span export), counted in
    kvobs_telemetry_errors_total{engine="", stage="export"} on every registry holding kvobs's families."""
    with _process_lock:
        reporter = _process_state.get("reporter")
        if reporter is None:
            if multiprocess_enabled():
                check_multiprocess_dir()
                counter = Counter(sc.TELEMETRY_ERRORS_TOTAL.removesuffix("_total"), _TELEMETRY_ERRORS_HELP,
                                  sc.METRIC_LABELS[sc.TELEMETRY_ERRORS_TOTAL], registry=None).labels("", STAGE_EXPORT)
            else:
                counter = CounterCell(threading.Lock())
            _process_state["cell"] = counter
            reporter = _process_state["reporter"] = TelemetryFailures("", {STAGE_EXPORT: counter})
    for families in list(MetricFamilies._live):
        _show_process_failures(families)
    return reporter


def _process_export_cell() -> Any:
    return _process_state.get("cell")


def _show_process_failures(families: MetricFamilies) -> None:
    cell = _process_export_cell()
    family = families.telemetry_errors
    if isinstance(cell, CounterCell) and isinstance(family, CounterFamily):
        with family._children_lock:
            family.children.setdefault(("", STAGE_EXPORT), cell)


def _after_fork_in_child() -> None:
    MetricFamilies._create_lock = threading.Lock()
    for families in list(MetricFamilies._live):
        families._after_fork_in_child()
    cell = _process_export_cell()
    if isinstance(cell, CounterCell):
        cell.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
