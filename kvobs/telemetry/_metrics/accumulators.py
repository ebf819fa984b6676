"""Plain accumulators for kvobs's metrics, exposed at scrape time exactly as prometheus_client's own.

Why: a prometheus_client child takes a lock and re-validates on every `inc`/`observe`, and one transfer
records seven values. Here a counter is a float and a histogram a list of bucket counts, a sum and one
exemplar per bucket, all guarded by the lock of the registry's families (writers that batch, see
`buffers.py`, take it once per batch). At scrape time each family builds the same `Metric` and
`Sample` objects prometheus_client's Counter, Histogram and Gauge build (names, HELP/TYPE, label order, `le`
formatting, `_created`, exemplars), so both exposition formats come out identical.

Scrape-time gauges read a callable when scraped. Their cells are owned by whoever binds them (an observer's
metrics), and held weakly by the family: a dropped observer takes its gauge series with it.
"""

from __future__ import annotations

import threading
import time
import weakref
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import prometheus_client.metrics as _prometheus_metrics
from opentelemetry.trace import SpanContext
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Exemplar
from prometheus_client.utils import INF, floatToGoString

from kvobs.telemetry._logs import context_fields

ExemplarLabels = dict[str, str]
# a histogram's exemplar: its labels, or the span context they are formatted from when scraped (the hex
# formatting costs more than the rest of recording it, and only the latest exemplar of a bucket is ever shown)
ExemplarSource = ExemplarLabels | SpanContext
Batch = tuple["HistogramCell", float, list[tuple[int, int]]]


def created_samples_enabled() -> bool:
    """prometheus_client's switch for `_created` samples (`disable_created_metrics()`,
    PROMETHEUS_DISABLE_CREATED_SERIES), honoured the same way."""
    return bool(getattr(_prometheus_metrics, "_use_created", True))


class CounterCell:
    """One counter series. `value` is written only under `lock`."""

    def __init__(self, lock: threading.Lock) -> None:
        self.value = 0.0
        self.created = time.time()
        self.exemplar: Exemplar | None = None
        self.lock = lock

    def inc(self, amount: float = 1, exemplar: ExemplarLabels | None = None) -> None:
        """prometheus_client's `Counter.inc`: negative amounts are refused."""
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        with self.lock:
            self.value += amount
            if exemplar:
                self.exemplar = Exemplar(exemplar, amount, time.time())

    def get(self) -> float:
        return self.value


class HistogramCell:
    """One histogram series: per-bucket counts (not cumulative), the sum, the latest exemplar per bucket."""

    def __init__(self, bounds: list[float], lock: threading.Lock) -> None:
        self.bounds = bounds  # ascending upper bounds, +Inf last
        self.buckets = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()
        # (labels, amount, timestamp) per bucket; the Exemplar tuple is built only when scraped
        self.exemplars: list[tuple[ExemplarSource, float, float] | None] = [None] * len(bounds)
        self.lock = lock

    def observe(self, amount: float, exemplar: ExemplarSource | None = None) -> None:
        """prometheus_client's `Histogram.observe`. The exemplar's labels are trusted (kvobs's trace ids)."""
        with self.lock:
            self.add(amount)
            if exemplar:
                self.set_exemplar(amount, exemplar, time.time())

    def observe_many(self, amounts: Iterable[float]) -> None:
        """Many observations in one step (a buffer flushing what it tallied): one lock, one sort."""
        with self.lock:
            self.commit(*self.prepare(list(amounts))[1:])

    def add(self, amount: float) -> None:
        """One observation; the caller holds `lock`. NaN joins the sum but no bucket, as in prometheus_client."""
        self.sum += amount
        if amount == amount:  # noqa: PLR0124 - false only for NaN, the cheapest test
            self.buckets[bisect_left(self.bounds, amount)] += 1

    def prepare(self, values: list[float]) -> Batch:
        """Many observations, worked out without changing this cell (the caller holds `lock`); `commit`
        applies them. Sorting once and cutting the sorted values at each bound costs far less than one bisect
        and one increment per value. `values` is sorted in place. Raises, changing nothing, on a value that
        is not a number."""
        total = sum(values, self.sum)  # in the order observed, as one `observe` after another would add
        if total != total:  # noqa: PLR0124 - a NaN among them (or in the sum already): a NaN joins no bucket
            values = [v for v in values if v == v]  # noqa: PLR0124
        values.sort()
        increments = []
        remaining = len(values)
        below = 0
        for index, bound in enumerate(self.bounds):
            if not remaining:
                break
            upto = bisect_right(values, bound)
            if upto != below:
                increments.append((index, upto - below))
                remaining -= upto - below
                below = upto
        return self, total, increments

    def commit(self, total: float, increments: list[tuple[int, int]]) -> None:
        """Apply what `prepare` worked out; the caller still holds `lock`."""
        self.sum = total
        buckets = self.buckets
        for index, count in increments:
            buckets[index] += count

    def set_exemplar(self, amount: float, labels: ExemplarSource, timestamp: float) -> None:
        """Keep the latest exemplar of the bucket `amount` falls in; the caller holds `lock`."""
        if amount != amount:  # noqa: PLR0124
            return  # NaN falls in no bucket
        self.keep_exemplar(bisect_left(self.bounds, amount), (labels, amount, timestamp))

    def keep_exemplar(self, index: int, exemplar: tuple[ExemplarSource, float, float]) -> None:
        """`exemplar` (source, amount, timestamp) for bucket `index`, unless the bucket holds a later one (threads'
        batches fold in any order); the caller holds `lock`."""
        current = self.exemplars[index]
        if current is None or current[2] <= exemplar[2]:
            self.exemplars[index] = exemplar

    def count(self) -> float:
        return float(sum(self.buckets))


class ScrapeReader:
    """A value read at scrape time: `read(owner)` with `owner` held weakly (0 once it is gone), or a plain
    `read()` held strongly. A reader that raises shows 0 and is reported through `on_error`."""

    __slots__ = ("_on_error", "_owner", "_read")

    def __init__(self, owner: Any, read: Callable[..., float], on_error: Callable[[], None] | None) -> None:
        if owner is None:
            self._owner = None
        else:
            try:
                self._owner = weakref.ref(owner)
            except TypeError:
                raise TypeError(
                    f"a scrape-time gauge holds its owner weakly; {type(owner).__name__} objects do not support "
                    "weak references: bind the object that owns the state instead"
                ) from None
        self._read = read
        self._on_error = on_error

    @property
    def alive(self) -> bool:
        return self._owner is None or self._owner() is not None

    def __call__(self) -> float:
        try:
            if self._owner is None:
                return float(self._read())
            owner = self._owner()
            return 0.0 if owner is None else float(self._read(owner))
        except Exception:  # noqa: BLE001 - a scrape never fails because of kvobs
            if self._on_error is not None:
                self._on_error()
            return 0.0


class GaugeCell:
    """One gauge series: a value set directly, or a ScrapeReader evaluated at each scrape."""

    __slots__ = ("__weakref__", "reader", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.reader: ScrapeReader | None = None

    def set(self, value: float) -> None:
        self.value = float(value)

    def bind(self, owner: Any, read: Callable[[Any], float], on_error: Callable[[], None] | None = None) -> None:
        """Read `read(owner)` at scrape time, holding `owner` weakly."""
        self.reader = ScrapeReader(owner, read, on_error)

    def set_function(self, read: Callable[[], float], on_error: Callable[[], None] | None = None) -> None:
        """Read `read()` at scrape time, holding it strongly (prometheus_client's `Gauge.set_function`)."""
        self.reader = ScrapeReader(None, read, on_error)

    def get(self) -> float:
        reader = self.reader
        return self.value if reader is None else reader()


class _Family:
    """What the three kinds share: name, help, label names, children in creation order."""

    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.children: Any = {}
        self._children_lock = threading.Lock()

    def _key(self, labelvalues: tuple[Any, ...], labelkwargs: dict[str, Any]) -> tuple[str, ...]:
        if labelkwargs:
            if labelvalues or sorted(labelkwargs) != sorted(self.labelnames):
                raise ValueError("Incorrect label names")
            labelvalues = tuple(labelkwargs[n] for n in self.labelnames)
        if len(labelvalues) != len(self.labelnames):
            raise ValueError("Incorrect label count")
        return tuple(str(v) for v in labelvalues)

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Any:
        """The child for these label values, created on first use (prometheus_client's `labels`)."""
        key = self._key(labelvalues, labelkwargs)
        with self._children_lock:
            child = self.children.get(key)
            if child is None:
                child = self._new_child()
                self.children[key] = child
            return child

    def _new_child(self) -> Any:
        raise NotImplementedError

    def show(self, labelvalues: tuple[str, ...], child: Any) -> None:
        """Show `child`, owned elsewhere, under `labelvalues` (unless a child is already there)."""
        with self._children_lock:
            self.children.setdefault(labelvalues, child)

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, self.kind)]

    def collect(self) -> list[Metric]:
        """The family with every child's samples, in prometheus_client's order."""
        metric = Metric(self.name, self.documentation, self.kind)
        with self._children_lock:
            children = list(self.children.items())
        for key, child in children:
            self._add_samples(metric, dict(zip(self.labelnames, key)), child)
        return [metric]

    def _add_samples(self, metric: Metric, labels: dict[str, str], child: Any) -> None:
        raise NotImplementedError

    def renew_after_fork(self, lock: threading.Lock) -> None:
        """In a forked child, where a lock another thread held at the fork stays held: fresh locks, `lock`
        for what the families' lock guarded."""
        self._children_lock = threading.Lock()


class _LockedFamily(_Family):
    """Counters and histograms: every child is written under one lock, shared with the families' batches."""

    lock: threading.Lock

    def renew_after_fork(self, lock: threading.Lock) -> None:
        super().renew_after_fork(lock)
        old = self.lock
        self.lock = lock
        for child in self.children.values():
            if child.lock is old:  # a child with a lock of its own (the process-wide one) keeps it
                child.lock = lock


class CounterFamily(_LockedFamily):
    kind = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], lock: threading.Lock) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames)
        self.lock = lock

    def _new_child(self) -> CounterCell:
        return CounterCell(self.lock)

    def _add_samples(self, metric: Metric, labels: dict[str, str], child: CounterCell) -> None:
        metric.add_sample(self.name + "_total", labels, child.value, None, child.exemplar)
        if created_samples_enabled():
            metric.add_sample(self.name + "_created", dict(labels), child.created, None, None)


class HistogramFamily(_LockedFamily):
    kind = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Iterable[float],
                 lock: threading.Lock) -> None:
        super().__init__(name, documentation, labelnames)
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError("Buckets not in sorted order")
        if bounds and bounds[-1] != INF:
            bounds.append(INF)
        if len(bounds) < 2:
            raise ValueError("Must have at least two buckets")
        self.bounds = bounds
        self._le = [floatToGoString(b) for b in bounds]
        self.lock = lock

    def _new_child(self) -> HistogramCell:
        return HistogramCell(self.bounds, self.lock)

    def _add_samples(self, metric: Metric, labels: dict[str, str], child: HistogramCell) -> None:
        name = self.name
        cumulative = 0.0
        for le, count, exemplar in zip(self._le, child.buckets, child.exemplars):
            cumulative += count
            metric.add_sample(name + "_bucket", {**labels, "le": le}, cumulative, None,
                              None if exemplar is None else _exposed(*exemplar))
        metric.add_sample(name + "_count", dict(labels), cumulative, None, None)
        if self.bounds[0] >= 0:
            metric.add_sample(name + "_sum", dict(labels), child.sum, None, None)
        if created_samples_enabled():
            metric.add_sample(name + "_created", dict(labels), child.created, None, None)


class GaugeFamily(_Family):
    """Children are held weakly: a gauge series lives as long as the object that asked for it."""

    kind = "gauge"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        super().__init__(name, documentation, labelnames)
        self.children = weakref.WeakValueDictionary()

    def _new_child(self) -> GaugeCell:
        return GaugeCell()

    def collect(self) -> list[Metric]:
        metric = Metric(self.name, self.documentation, self.kind)
        with self._children_lock:
            children = [(key, cell) for key, cell in list(self.children.items())]
        for key, cell in children:  # read outside the lock: a reader may take its owner's locks
            metric.add_sample(self.name, dict(zip(self.labelnames, key)), cell.get(), None, None)
        return [metric]


def _exposed(source: ExemplarSource, amount: float, timestamp: float) -> Exemplar:
    labels = source if isinstance(source, dict) else context_fields(source)
    return Exemplar(labels, amount, timestamp)
