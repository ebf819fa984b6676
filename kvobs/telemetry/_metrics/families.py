"""Every kvobs metric family of one registry, registered as one collector.

All families go in one `register` call, so a registry already holding a conflicting name gets none of them
(MetricNameConflict) and stays usable. In a single process they are plain accumulators (accumulators.py),
fed by per-thread buffers that the collector folds in before each scrape (buffers.py); under
PROMETHEUS_MULTIPROC_DIR they are prometheus_client's own, whose values live in per-process files the
scraping process reads, and a thread copies scrape-time gauges into those files (refresher.py).

What observers record lives with the families, not with an observer: a new observer with the same engine
label continues the counts. One live observer per engine label per registry, so two never share (and hide)
each other's series.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, ClassVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from kvobs import semconv as sc
from kvobs._runtime.forks import renewed_after_fork
from kvobs.errors import DuplicateEngine, MetricNameConflict
from kvobs.telemetry._failures import TELEMETRY_ERRORS_HELP, Failed
from kvobs.telemetry._metrics.accumulators import CounterFamily, GaugeCell, GaugeFamily, HistogramFamily
from kvobs.telemetry._metrics.buffers import ThreadBuffers
from kvobs.telemetry._metrics.multiprocess import (
    FILE_SPACE,
    ReservedMetric,
    check_multiprocess_dir,
    multiprocess_enabled,
)
from kvobs.telemetry._metrics.refresher import Refresher
from kvobs.telemetry._process_failures import process_failures, show_process_failures

__all__ = ["FAMILY_SPECS", "Failed", "MetricFamilies", "MultiprocessGaugeFamily"]


# attribute, metric name, kind, help, multiprocess mode of a gauge
FAMILY_SPECS: tuple[tuple[str, str, str, str, str], ...] = (
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
    ("telemetry_errors", sc.TELEMETRY_ERRORS_TOTAL, "counter", TELEMETRY_ERRORS_HELP, ""),
)


class MultiprocessGaugeFamily(GaugeFamily):
    """A gauge family whose cells are copied into a prometheus_client multiprocess gauge by the refresher."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...], mode: str) -> None:
        super().__init__(name, documentation, labelnames)
        self.gauge = ReservedMetric(Gauge(name, documentation, labelnames, registry=None, multiprocess_mode=mode),
                                    "gauge", name, documentation, labelnames, mode)
        self._watched: weakref.WeakSet[GaugeCell] = weakref.WeakSet()

    def watch(self, cell: GaugeCell, labelvalues: tuple[str, ...], failed: Failed) -> None:
        if cell not in self._watched:
            self._watched.add(cell)
            Refresher.shared().watch(cell, self.gauge.labels(*labelvalues), failed)

    def describe(self) -> list[Metric]:
        return self.gauge.describe()

    def collect(self) -> list[Metric]:
        return self.gauge.collect()


class MetricFamilies:
    """Every kvobs metric family of one registry (attributes named as in FAMILY_SPECS). Shared by every
    observer of that registry; `MetricFamilies.of(registry)` finds or creates it."""

    _by_registry: ClassVar[weakref.WeakKeyDictionary[CollectorRegistry, MetricFamilies]] = (
        weakref.WeakKeyDictionary())
    _create_lock = threading.Lock()

    def __init__(self, registry: CollectorRegistry, buckets: tuple[float, ...]) -> None:
        self._registry = weakref.ref(registry)
        self.buckets = buckets
        self.multiprocess = multiprocess_enabled()
        if self.multiprocess:
            check_multiprocess_dir()
            process_failures()  # its counters' series first, so a file found full later can still count it
        self.lock = threading.Lock()  # every accumulator and buffer; drains and scrapes take it
        self.failure_lock = threading.Lock()  # the telemetry-error counters, counted from inside drains
        self.ordered: list[Any] = []
        for attribute, name, kind, documentation, mode in FAMILY_SPECS:
            family = self._family(name, kind, documentation, mode)
            setattr(self, attribute, family)
            self.ordered.append(family)
        self._shared: dict[Hashable, Any] = {}
        self._buffers: list[ThreadBuffers] = []
        self._engines: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self._structure_lock = threading.Lock()
        try:
            registry.register(_Collector(self))
        except ValueError as exc:
            raise MetricNameConflict(str(exc)) from None
        self._show_build_info()
        show_process_failures(self.telemetry_errors)
        _LIVE.add(self)

    def _family(self, name: str, kind: str, documentation: str, mode: str) -> Any:
        labelnames = sc.METRIC_LABELS[name]
        if self.multiprocess:
            if kind == "counter":
                counter = Counter(name.removesuffix("_total"), documentation, labelnames, registry=None)
                return ReservedMetric(counter, kind, name, documentation, labelnames)
            if kind == "histogram":
                histogram = Histogram(name, documentation, labelnames, buckets=self.buckets, registry=None)
                return ReservedMetric(histogram, kind, name, documentation, labelnames, buckets=self.buckets)
            return MultiprocessGaugeFamily(name, documentation, labelnames, mode)
        if kind == "counter":
            lock = self.failure_lock if name == sc.TELEMETRY_ERRORS_TOTAL else self.lock
            return CounterFamily(name, documentation, labelnames, lock)
        if kind == "histogram":
            return HistogramFamily(name, documentation, labelnames, self.buckets, self.lock)
        return GaugeFamily(name, documentation, labelnames)

    def _show_build_info(self) -> None:
        from kvobs._version import __version__

        self._build_info = self.build_info.labels(__version__)  # held here: gauge families hold cells weakly
        self._build_info.set(1)
        if isinstance(self.build_info, MultiprocessGaugeFamily):
            self.build_info.gauge.labels(__version__).set(1)

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

    def claim_engine(self, engine: str, metrics: object) -> None:
        """Let `metrics` use the engine label, unless another live one already does (DuplicateEngine)."""
        for generation in (0, 1, 2, None):
            with self._structure_lock:
                if self._engines.get(engine) in (None, metrics):
                    self._engines[engine] = metrics
                    return
            if generation is not None:
                gc.collect(generation)  # an observer the engine dropped may wait in a cycle: youngest first
        raise DuplicateEngine(engine)

    def shared(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """What is kept under `key`, made by `make()` on first use: kept with the families, so the series a
        path or holder records continue across observers."""
        with self._structure_lock:
            found = self._shared.get(key)
            if found is None:
                found = self._shared[key] = make()
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
            if isinstance(family, (CounterFamily, HistogramFamily, GaugeFamily)):
                family.renew_after_fork(self.failure_lock if family is self.telemetry_errors else self.lock)
        for buffers in self._buffers:
            buffers.lock = self.lock

    @classmethod
    def _renew_create_lock(cls) -> None:
        cls._create_lock = threading.Lock()


_LIVE = renewed_after_fork(MetricFamilies._after_fork_in_child)
os.register_at_fork(after_in_child=MetricFamilies._renew_create_lock)


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
            if not FILE_SPACE.writable():  # reading a value rewrites a forked child's files: they need space
                return
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
