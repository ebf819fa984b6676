"""kvobs's own accumulators expose exactly what prometheus_client's Counter, Histogram and Gauge expose.

The same observations go through kvobs's recording calls on one registry and through prometheus_client's
own families (the documented meaning of each call, written out) on another; both exposition formats must
match line for line, `_created` timestamps and exemplar timestamps aside.
"""

from __future__ import annotations

import math
import re

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics

from kvobs import __version__
from kvobs import semconv as sc
from kvobs.telemetry._metrics.accumulators import CounterFamily, GaugeFamily
from kvobs.telemetry._metrics.engine_metrics import EngineMetrics
from kvobs.telemetry._metrics.families import FAMILY_SPECS, MetricFamilies

ENGINE, LOCK = "expo", "cache"
EX1 = {"trace_id": "0af7651916cd43dd8448eb211c80319c", "span_id": "b7ad6b7169203331"}
EX2 = {"trace_id": "1bf7651916cd43dd8448eb211c80319d", "span_id": "c7ad6b7169203332"}


def s(k: int) -> float:
    """k / 2**20 seconds: dyadic, so sums are exact whatever the order of additions."""
    return k / 2**20


class Reference:
    """prometheus_client's own families, named and documented like kvobs's, with each recording call of
    kvobs written out as the prometheus_client calls it stands for."""

    def __init__(self, registry: CollectorRegistry, buckets: tuple[float, ...]) -> None:
        self.families = {}
        for attribute, name, kind, documentation, _mode in FAMILY_SPECS:
            labels = sc.METRIC_LABELS[name]
            if kind == "counter":
                family = Counter(name.removesuffix("_total"), documentation, labels, registry=registry)
            elif kind == "histogram":
                family = Histogram(name, documentation, labels, buckets=buckets, registry=registry)
            else:
                family = Gauge(name, documentation, labels, registry=registry)
            self.families[attribute] = family

    def __getattr__(self, attribute: str):
        return self.families[attribute]

    def create_children_like(self, families: MetricFamilies) -> None:
        """Create children in kvobs's order (exposition lists series in creation order); copy the values of
        series this test does not drive (process-wide ones other tests may have counted)."""
        for attribute, family in zip(self.families, families.ordered):
            for key, cell in list(family.children.items()):
                child = self.families[attribute].labels(*key)
                if isinstance(family, CounterFamily) and key[0] == "":
                    child.inc(cell.value)
                if isinstance(family, GaugeFamily) and key[0] == __version__:
                    child.set(1)

    # what kvobs's calls mean, in prometheus_client's terms
    def finished(self, path, outcome, duration, wait, hold, blocks, nbytes, exemplar):
        self.transfers.labels(ENGINE, path, outcome).inc()
        self.duration.labels(ENGINE, path, outcome).observe(duration, exemplar)
        self.lock_wait.labels(ENGINE, LOCK, path).observe(wait, exemplar)
        self.lock_hold.labels(ENGINE, LOCK, path).observe(hold)
        if outcome == sc.OUTCOME_OK:
            self.blocks.labels(ENGINE, path).inc(blocks)
            self.bytes.labels(ENGINE, path).inc(nbytes)

    def timed_out(self, path, waited, exemplar):
        self.lock_timeouts.labels(ENGINE, LOCK, path).inc()
        self.lock_wait.labels(ENGINE, LOCK, path).observe(waited, exemplar)
        self.transfers.labels(ENGINE, path, sc.OUTCOME_TIMEOUT).inc()
        self.duration.labels(ENGINE, path, sc.OUTCOME_TIMEOUT).observe(waited, exemplar)


def drive(metrics: EngineMetrics, ref: Reference | None) -> None:
    """The same calls on kvobs (ref None) or on the reference."""
    send, swap = sc.PATH_SEND, "swap_in"
    records = [
        (send, sc.OUTCOME_OK, s(300), s(12), s(288), 4, 4096, None),
        (send, sc.OUTCOME_OK, s(300), s(20), s(280), 2, 2048, EX1),
        (send, sc.OUTCOME_OK, s(310), s(21), s(289), 1, 1024, EX2),  # same buckets: EX2 must win
        (send, sc.OUTCOME_ERROR, s(5000), s(4000), s(1000), 8, 8192, EX1),
        (send, sc.OUTCOME_ABANDONED, s(2**22), s(1), s(2**22 - 1), 3, 0, None),
        (swap, sc.OUTCOME_OK, s(1 << 25), s(0), math.nan, 16, 1 << 20, None),  # NaN: in the sum, no bucket
        ("edge", sc.OUTCOME_OK, 0.001, 0.00025, 0.0025, 1, 1, None),  # on the bounds: `le` includes them
    ]
    for path, *record in records:
        if ref is None:
            metrics.path(path).finished(*record)
        else:
            ref.finished(path, *record)
    if ref is None:
        pm = metrics.path(send)
        pm.timed_out(s(3 << 20), EX2)
        pm.rejected()
        pm.checked(sc.CHECK_NAN, 3)
        pm.checked(sc.CHECK_CLEAN, 0)
        pm.conflicted(sc.HOLDER_FORWARD)
        pm.conflicted(sc.PATH_PREFETCH)
        pm.conflicted(sc.HOLDER_FORWARD)
        forward = metrics.holder(sc.HOLDER_FORWARD)
        forward.held(s(40), s(9000), EX1)
        forward.held(s(41), s(9100), None)
        forward.timed_out(s(1 << 21), EX2)
        metrics.signals[sc.SIGNAL_RECOVERED].inc()
        metrics.signals[sc.SIGNAL_RECOVERED].inc(2)
        metrics.signal_buffered.observe(s(77))
        metrics.signal_buffered.observe(0.005)
        metrics.signal_buffered.observe(math.nan)
        metrics.signal_buffered.observe_many([s(5), 0.01, s(1 << 30)])
        metrics.count_telemetry_error("hook")
        return
    ref.timed_out(send, s(3 << 20), EX2)
    ref.transfers.labels(ENGINE, send, sc.OUTCOME_REJECTED).inc()
    ref.nan_checks.labels(ENGINE, send, sc.CHECK_NAN).inc()
    ref.nan_blocks.labels(ENGINE, send).inc(3)
    ref.nan_checks.labels(ENGINE, send, sc.CHECK_CLEAN).inc()
    ref.lock_conflicts.labels(ENGINE, LOCK, send, sc.HOLDER_FORWARD).inc(2)
    ref.lock_conflicts.labels(ENGINE, LOCK, send, sc.PATH_PREFETCH).inc()
    ref.lock_wait.labels(ENGINE, LOCK, sc.HOLDER_FORWARD).observe(s(40), EX1)
    ref.lock_hold.labels(ENGINE, LOCK, sc.HOLDER_FORWARD).observe(s(9000))
    ref.lock_wait.labels(ENGINE, LOCK, sc.HOLDER_FORWARD).observe(s(41))
    ref.lock_hold.labels(ENGINE, LOCK, sc.HOLDER_FORWARD).observe(s(9100))
    ref.lock_timeouts.labels(ENGINE, LOCK, sc.HOLDER_FORWARD).inc()
    ref.lock_wait.labels(ENGINE, LOCK, sc.HOLDER_FORWARD).observe(s(1 << 21), EX2)
    ref.signals.labels(ENGINE, sc.SIGNAL_RECOVERED).inc(3)
    ref.signal_buffered.labels(ENGINE).observe(s(77))
    ref.signal_buffered.labels(ENGINE).observe(0.005)
    ref.signal_buffered.labels(ENGINE).observe(math.nan)
    for value in (s(5), 0.01, s(1 << 30)):
        ref.signal_buffered.labels(ENGINE).observe(value)
    ref.telemetry_errors.labels(ENGINE, "hook").inc()


class Owner:
    """Something a scrape-time gauge reads."""

    def __init__(self, value: float) -> None:
        self.value = value


def bind_gauges(metrics: EngineMetrics, ref: Reference | None, owner: Owner) -> None:
    if ref is None:
        metrics.bind_lock_held(owner, lambda o: o.value)
        metrics.bind_open_transfers(sc.PATH_SEND, owner, lambda o: 2, lambda o: o.value * 2)
        metrics.bind_blocks_claimed(sc.CLAIM_SHARED, owner, lambda o: 12)
        metrics.bind_pending_signals(owner, lambda o: 5, lambda o: 0.25)
        return
    ref.lock_held.labels(ENGINE, LOCK).set_function(lambda: owner.value)
    ref.in_flight.labels(ENGINE, sc.PATH_SEND).set_function(lambda: 2)
    ref.oldest_open_age.labels(ENGINE, sc.PATH_SEND).set_function(lambda: owner.value * 2)
    ref.blocks_claimed.labels(ENGINE, LOCK, sc.CLAIM_SHARED).set_function(lambda: 12)
    ref.pending.labels(ENGINE).set_function(lambda: 5)
    ref.oldest_age.labels(ENGINE).set_function(lambda: 0.25)


def normalised(text: str) -> str:
    """Timestamps of `_created` samples and of exemplars replaced; everything else kept."""
    text = re.sub(r"^(\S+_created(?:\{[^}]*\})?) \S+$", r"\1 <created>", text, flags=re.MULTILINE)
    return re.sub(r"( # \{[^}]*\} \S+) \S+$", r"\1 <timestamp>", text, flags=re.MULTILINE)


@pytest.fixture
def both():
    buckets = sc.DEFAULT_LATENCY_BUCKETS
    ours = CollectorRegistry()
    metrics = EngineMetrics(MetricFamilies.of(ours, buckets), ENGINE, LOCK)
    owner = Owner(1.5)
    bind_gauges(metrics, None, owner)
    drive(metrics, None)
    theirs = CollectorRegistry()
    ref = Reference(theirs, buckets)
    ref.create_children_like(metrics.families)
    bind_gauges(metrics, ref, owner)
    drive(metrics, ref)
    yield ours, theirs, metrics, owner, ref


def test_text_exposition_is_identical_to_prometheus_client(both):
    ours, theirs, *_ = both
    mine, reference = normalised(generate_latest(ours).decode()), normalised(generate_latest(theirs).decode())
    assert mine == reference
    assert 'kvobs_lock_hold_seconds_sum{engine="expo",lock="cache",path="swap_in"} NaN' in mine
    assert 'kvobs_lock_conflicts_total{engine="expo",holder_path="forward",lock="cache",path="send"} 2.0' in mine


def test_openmetrics_exposition_with_exemplars_is_identical(both):
    ours, theirs, *_ = both
    mine, reference = normalised(openmetrics(ours).decode()), normalised(openmetrics(theirs).decode())
    assert mine == reference
    exemplars = [line for line in mine.splitlines() if " # {" in line]
    assert len(exemplars) >= 5
    assert any(EX2["trace_id"] in line and 'le="0.0005"' in line for line in exemplars)


def test_exposition_stays_identical_after_more_calls(both):
    """Buffered records left from before and new ones: a later scrape folds both in."""
    ours, theirs, metrics, owner, ref = both
    generate_latest(ours)
    owner.value = 7.0
    for _ in range(3):
        metrics.path(sc.PATH_SEND).finished(sc.OUTCOME_OK, s(2), s(1), s(1), 1, 8, None)
        ref.finished(sc.PATH_SEND, sc.OUTCOME_OK, s(2), s(1), s(1), 1, 8, None)
    assert normalised(openmetrics(ours).decode()) == normalised(openmetrics(theirs).decode())


def test_created_samples_follow_prometheus_client_switch(both):
    ours, theirs, *_ = both
    prometheus_client.disable_created_metrics()
    try:
        mine = generate_latest(ours).decode()
        assert "_created" not in mine
        assert mine == generate_latest(theirs).decode()
    finally:
        prometheus_client.enable_created_metrics()


def test_empty_families_are_exposed_like_prometheus_client():
    """A registry with kvobs's families and no observer yet: every family, with its HELP and TYPE."""
    ours = CollectorRegistry()
    families = MetricFamilies.of(ours)
    theirs = CollectorRegistry()
    Reference(theirs, families.buckets).create_children_like(families)
    assert normalised(generate_latest(ours).decode()) == normalised(generate_latest(theirs).decode())
    assert [m.name for m in ours.collect()] == [m.name for m in theirs.collect()]


class Tally:
    """A buffer that counts privately and flushes into the counter when its gauge is read (signals do)."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics, self.unflushed = metrics, 0

    def pending(self) -> float:
        self.metrics.signals[sc.SIGNAL_READY].inc(self.unflushed)
        self.unflushed = 0
        return 1.0


def test_what_a_gauge_reader_flushes_is_in_the_same_scrape():
    registry = CollectorRegistry()
    metrics = EngineMetrics(MetricFamilies.of(registry), "flush", "cache")
    tally = Tally(metrics)
    metrics.bind_pending_signals(tally, Tally.pending, lambda owner: 0.0)
    tally.unflushed = 5
    assert registry.get_sample_value(sc.SIGNALS_TOTAL, {"engine": "flush", "outcome": "ready"}) == 5


def test_exemplars_from_span_contexts_match_prometheus_client_over_many_batches():
    """kvobs keeps a traced call's span context and formats its ids only when scraped, and folds a batch's
    exemplars newest first, stopping once every bucket the batch touched has one: whatever the mix (records
    without exemplars, NaN, several outcomes, batches folded when a thread's buffer fills), each bucket shows the
    latest exemplar, as prometheus_client's per-observation `observe(amount, exemplar)` does."""
    import random

    from opentelemetry.trace import SpanContext, TraceFlags

    rng = random.Random(11)
    contexts = [SpanContext(rng.getrandbits(128), rng.getrandbits(64), False, TraceFlags(1)) for _ in range(9)]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    buckets = sc.DEFAULT_LATENCY_BUCKETS
    metrics = EngineMetrics(MetricFamilies.of(ours, buckets), ENGINE, LOCK)
    ref = Reference(theirs, buckets)
    send = metrics.path(sc.PATH_SEND)
    ref.create_children_like(metrics.families)
    outcomes = [sc.OUTCOME_OK] * 6 + [sc.OUTCOME_ERROR, sc.OUTCOME_ABANDONED]
    amounts = [0.0, 1e-5, 3e-4, 0.02, 0.7, 40.0, math.nan]
    for _ in range(7500):
        outcome, context = rng.choice(outcomes), rng.choice(contexts + [None] * 3)
        duration, wait = rng.choice(amounts), rng.choice(amounts[:4])
        labels = None if context is None else {"trace_id": format(context.trace_id, "032x"),
                                               "span_id": format(context.span_id, "016x")}
        send.finished(outcome, duration, wait, 1e-4, 1, 8, context)
        ref.finished(sc.PATH_SEND, outcome, duration, wait, 1e-4, 1, 8, labels)
    mine, reference = normalised(openmetrics(ours).decode()), normalised(openmetrics(theirs).decode())
    assert mine == reference
    assert sum(" # {" in line for line in mine.splitlines()) >= 15
