"""The Prometheus metrics of DESIGN.md section 3, defined once per registry, with pre-bound children.

Why pre-bound: `.labels()` costs ~3 us per call; every label value kvobs uses (engine, path, outcome, lock,
result) is known when an observer is built, so the hot path only touches cached children.
Multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`) is handled by prometheus_client's mmap values; gauges pick a
multiprocess aggregation that makes sense across workers, and scrape-time gauges are refreshed by a
background thread there because `set_function` cannot cross processes.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.samples import Exemplar

from kvobs import semconv as sc

TELEMETRY_STAGES = ("metrics", "tracing", "logging", "hook", "scrape")


def multiprocess_enabled() -> bool:
    """True when prometheus_client writes values to per-process mmap files."""
    return bool(os.environ.get(sc.ENV_MULTIPROC_DIR))


class MetricFamilies:
    """All kvobs metric families registered on one registry. Shared by every observer of that registry."""

    _by_registry: "weakref.WeakKeyDictionary[CollectorRegistry, MetricFamilies]" = weakref.WeakKeyDictionary()
    _create_lock = threading.Lock()

    def __init__(self, registry: CollectorRegistry, buckets: tuple[float, ...]) -> None:
        self.registry = registry
        self.buckets = buckets

        def counter(name: str, doc: str) -> Counter:
            return Counter(name.removesuffix("_total"), doc, sc.METRIC_LABELS[name], registry=registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, sc.METRIC_LABELS[name], buckets=buckets, registry=registry)

        def gauge(name: str, doc: str, mode: str) -> Gauge:
            return Gauge(name, doc, sc.METRIC_LABELS[name], registry=registry, multiprocess_mode=mode)

        self.transfers = counter(sc.TRANSFERS_TOTAL, "Guarded KV transfers by outcome.")
        self.duration = histogram(sc.TRANSFER_DURATION_SECONDS, "Wall time of a guarded transfer call.")
        self.blocks = counter(sc.TRANSFER_BLOCKS_TOTAL, "KV blocks moved by guarded transfers.")
        self.bytes = counter(sc.TRANSFER_BYTES_TOTAL, "Bytes moved by guarded transfers.")
        self.in_flight = gauge(sc.TRANSFERS_IN_FLIGHT, "Guarded transfers running now.", "livesum")
        self.lock_wait = histogram(sc.LOCK_WAIT_SECONDS, "Time spent waiting for the cache lock.")
        self.lock_hold = histogram(sc.LOCK_HOLD_SECONDS, "Time the cache lock was held per transfer.")
        self.lock_timeouts = counter(sc.LOCK_TIMEOUTS_TOTAL, "Cache lock acquisitions that timed out.")
        self.lock_held = gauge(
            sc.LOCK_HELD_SECONDS, "How long the current holder has held the lock; 0 when free.", "livemax"
        )
        self.nan_checks = counter(sc.NAN_CHECKS_TOTAL, "NaN/Inf checks of transferred KV blocks by result.")
        self.nan_blocks = counter(sc.NAN_BLOCKS_TOTAL, "KV blocks found holding NaN or Inf.")
        self.pending = gauge(sc.PENDING_SIGNALS, "Early layer0 signals waiting for their task.", "livesum")
        self.oldest_age = gauge(
            sc.PENDING_SIGNAL_OLDEST_AGE_SECONDS, "Age of the oldest pending early signal; 0 when none.", "livemax"
        )
        self.signals = counter(sc.SIGNALS_TOTAL, "Layer0 signal decisions by outcome.")
        self.signal_buffered = histogram(
            sc.SIGNAL_BUFFERED_SECONDS, "Time an early signal waited before it was recovered."
        )
        self.build_info = gauge(sc.BUILD_INFO, "kvobs version, always 1.", "max")
        self.telemetry_errors = counter(
            sc.TELEMETRY_ERRORS_TOTAL, "Telemetry failures swallowed so the engine call is unaffected."
        )
        from kvobs import __version__

        self.build_info.labels(__version__).set(1)

    @classmethod
    def of(cls, registry: CollectorRegistry | None, buckets: Iterable[float] | None = None) -> "MetricFamilies":
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


class InFlight:
    """Transfers running now. A deque's append/pop are atomic and cost ~30 ns, against ~850 ns for each
    locked Gauge update; the gauge reads `len()` at scrape time instead."""

    def __init__(self) -> None:
        running: deque[None] = deque()
        self.start = functools.partial(running.append, None)
        self.finish = running.pop
        self.count = running.__len__


@dataclass(frozen=True)
class PathMetrics:
    """Children for one (engine, path), plus the lock it takes."""

    transfers: dict[str, Any]
    duration: dict[str, Any]
    blocks: Any
    bytes: Any
    in_flight: InFlight
    lock_wait: Any
    lock_hold: Any
    lock_timeouts: Any
    nan_checks: dict[str, Any]
    nan_blocks: Any


@dataclass
class EngineMetrics:
    """Every pre-bound child one observer needs."""

    families: MetricFamilies
    engine: str
    lock_name: str
    paths: dict[str, PathMetrics] = field(default_factory=dict)

    def __post_init__(self) -> None:
        f, e, lk = self.families, self.engine, self.lock_name
        for path in sc.PATHS:
            self.add_path(path)
        self.lock_held = f.lock_held.labels(e, lk)
        self.pending = f.pending.labels(e)
        self.oldest_age = f.oldest_age.labels(e)
        self.signals = {o: f.signals.labels(e, o) for o in sc.SIGNAL_OUTCOMES}
        self.signal_buffered = f.signal_buffered.labels(e)
        self.telemetry_errors = {s: f.telemetry_errors.labels(e, s) for s in TELEMETRY_STAGES}

    def add_path(self, path: str) -> PathMetrics:
        f, e, lk = self.families, self.engine, self.lock_name
        pm = PathMetrics(
            transfers={o: f.transfers.labels(e, path, o) for o in sc.TRANSFER_OUTCOMES},
            duration={o: f.duration.labels(e, path, o) for o in sc.TRANSFER_OUTCOMES},
            blocks=f.blocks.labels(e, path),
            bytes=f.bytes.labels(e, path),
            in_flight=InFlight(),
            lock_wait=f.lock_wait.labels(e, lk, path),
            lock_hold=f.lock_hold.labels(e, lk, path),
            lock_timeouts=f.lock_timeouts.labels(e, lk, path),
            nan_checks={r: f.nan_checks.labels(e, path, r) for r in sc.CHECK_RESULTS},
            nan_blocks=f.nan_blocks.labels(e, path),
        )
        bind_scrape_time(f.in_flight.labels(e, path), pm.in_flight.count, lambda: self.count_telemetry_error("scrape"))
        self.paths[path] = pm
        return pm

    def lock_children(self, holder: str) -> tuple[Any, Any, Any]:
        """Lock wait, hold and timeout children for a holder that is not a transfer path (the forward pass)."""
        f, e, lk = self.families, self.engine, self.lock_name
        return f.lock_wait.labels(e, lk, holder), f.lock_hold.labels(e, lk, holder), f.lock_timeouts.labels(e, lk, holder)

    def count_telemetry_error(self, stage: str) -> None:
        """Count a swallowed telemetry failure; never raises itself."""
        try:
            self.telemetry_errors[stage].inc()
        except Exception:  # noqa: BLE001 - the counter of last resort must not raise either
            pass


def observe(child: Any, amount: float, exemplar: dict[str, str] | None) -> None:
    """`child.observe(amount, exemplar)` without its per-call exemplar validation (~3 us of ~4).

    kvobs's exemplar labels (trace_id, span_id) are valid by construction, so the exemplar is set on its
    bucket directly; the public call is used should prometheus_client's internals ever differ.
    """
    buckets = getattr(child, "_buckets", None) if exemplar is not None else None
    bounds = getattr(child, "_upper_bounds", None)
    if buckets is None or bounds is None:
        child.observe(amount, exemplar)
        return
    child.observe(amount)
    buckets[bisect_left(bounds, amount)].set_exemplar(Exemplar(exemplar, amount, time.time()))


def bind_scrape_time(gauge_child: Any, read: Callable[[], float], on_error: Callable[[], None]) -> None:
    """Make `gauge_child` show `read()` as of scrape time.

    Single process: `set_function`, evaluated during the scrape. Multiprocess: a daemon thread writes the
    value every `refresh_interval` seconds, since the scraping process cannot call into this one.
    A `read` that raises shows 0 and is counted through `on_error`; a scrape never fails because of it.
    """

    def safe_read() -> float:
        try:
            return float(read())
        except Exception:  # noqa: BLE001 - a scrape must never fail because of kvobs
            on_error()
            return 0.0

    if multiprocess_enabled():
        _Refresher.shared().add(gauge_child, safe_read)
    else:
        gauge_child.set_function(safe_read)


class _Refresher:
    """One daemon thread per process that copies scrape-time values into multiprocess gauges."""

    refresh_interval = 0.5
    _instance: "_Refresher | None" = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self._entries: list[tuple[Any, Callable[[], float]]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvobs-gauge-refresher", daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> "_Refresher":
        with cls._instance_lock:
            if cls._instance is None or not cls._instance._thread.is_alive():
                cls._instance = cls()
            return cls._instance

    def add(self, gauge_child: Any, read: Callable[[], float]) -> None:
        with self._lock:
            self._entries.append((gauge_child, read))
        gauge_child.set(read())

    def _run(self) -> None:
        while True:
            time.sleep(self.refresh_interval)
            with self._lock:
                entries = list(self._entries)
            for child, read in entries:
                try:
                    child.set(read())
                except Exception:  # noqa: BLE001 - keep refreshing the others
                    pass
