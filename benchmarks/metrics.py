"""Cost of kvobs's metric recording against prometheus_client's children and the plain-Python prototype.

    python benchmarks/metrics.py [--n 2000] [--repeats 60]

Prints a markdown table of ns per call, then the ratios the targets are stated in (issue 11, item 1: a
metrics-only guarded call <= 0.3x the hand-stacked `lock + Histogram.time() + span` and <= 3x a bare
`with threading.Lock():`). The guarded call itself belongs to the lifecycle (benchmarks/overhead.py); here
"recording call" is the same shape built from the primitives: the lock taken and released, three clock
reads, and one `PathMetrics.finished(...)`. `finished` buffers per thread and folds batches in as it goes,
so its per-call time includes that work; the fold-in a scrape does is measured on its own. Cases run
round-robin; a ratio is the median of the ratios taken within each round.
"""

from __future__ import annotations

import argparse
import threading
import time
from bisect import bisect_left
from collections.abc import Callable

from _timing import medians, per_round, rounds_ns
from opentelemetry import trace as otel_trace
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvobs import semconv as sc
from kvobs.telemetry._metrics.engine_metrics import EngineMetrics
from kvobs.telemetry._metrics.families import MetricFamilies
from kvobs.telemetry._metrics.path_metrics import PathMetrics

OK = sc.OUTCOME_OK
EXEMPLAR = {"trace_id": "0af7651916cd43dd8448eb211c80319c", "span_id": "b7ad6b7169203331"}
VALUES = [(0.00002 + (i % 13) * 0.00001, 0.000001 * (i % 5), 0.00002 + (i % 11) * 0.00001) for i in range(4096)]


def loop(fn: Callable[[], object]) -> Callable[[int], None]:
    def run(n: int) -> None:
        for _ in range(n):
            fn()

    return run


def finishing(finished: Callable[..., None], exemplar: dict[str, str] | None = None) -> Callable[[int], None]:
    """`finished` over varied durations (sorting a batch of equal values would flatter the buffered path)."""

    def run(n: int) -> None:
        values = VALUES
        for i in range(n):
            duration, wait, hold = values[i & 4095]
            finished(OK, duration, wait, hold, 4, 4096, exemplar)

    return run


def prometheus_finished(registry: CollectorRegistry) -> Callable[..., None]:
    """What `finished` records, done with prometheus_client's own children (exemplars set as kvobs sets
    them on its multiprocess path: through `observe(amount, exemplar)`)."""
    labels = sc.METRIC_LABELS
    transfers = Counter("p_transfers", "t", labels[sc.TRANSFERS_TOTAL], registry=registry).labels("b", "send", OK)
    duration = Histogram("p_duration", "d", labels[sc.TRANSFER_DURATION_SECONDS], registry=registry,
                         buckets=sc.DEFAULT_LATENCY_BUCKETS).labels("b", "send", OK)
    lock_histograms = Histogram("p_lock", "l", labels[sc.LOCK_WAIT_SECONDS], registry=registry,
                                buckets=sc.DEFAULT_LATENCY_BUCKETS)
    wait = lock_histograms.labels("b", "cache", "send")
    hold = lock_histograms.labels("b", "cache", "hold")
    blocks_bytes = Counter("p_moved", "m", labels[sc.TRANSFER_BLOCKS_TOTAL], registry=registry)
    blocks = blocks_bytes.labels("b", "send")
    nbytes = blocks_bytes.labels("b", "bytes")

    def finished(outcome, duration_s, wait_s, hold_s, n_blocks, n_bytes, exemplar):
        transfers.inc()
        duration.observe(duration_s, exemplar)
        wait.observe(wait_s, exemplar)
        hold.observe(hold_s)
        blocks.inc(n_blocks)
        nbytes.inc(n_bytes)

    return finished


def issue_prototype() -> Callable[[], None]:
    """The issue's plain-Python prototype: take the lock, record wait, hold and duration into bucket arrays
    with `bisect`, count the outcome."""
    lock = threading.Lock()
    clock = time.perf_counter
    bounds = [*sc.DEFAULT_LATENCY_BUCKETS, float("inf")]
    wait_buckets, hold_buckets, duration_buckets = ([0] * len(bounds) for _ in range(3))
    sums = [0.0, 0.0, 0.0]
    outcomes = {OK: 0}

    def call() -> None:
        t0 = clock()
        lock.acquire()
        t1 = clock()
        lock.release()
        t2 = clock()
        wait = t1 - t0
        hold = t2 - t1
        duration = t2 - t0
        wait_buckets[bisect_left(bounds, wait)] += 1
        sums[0] += wait
        hold_buckets[bisect_left(bounds, hold)] += 1
        sums[1] += hold
        duration_buckets[bisect_left(bounds, duration)] += 1
        sums[2] += duration
        outcomes[OK] += 1

    return call


def recording_call(finished: Callable[..., None]) -> Callable[[], None]:
    """A metrics-only guarded call's shape: lock, three clock reads, one `finished`."""
    lock = threading.Lock()
    clock = time.perf_counter

    def call() -> None:
        t0 = clock()
        lock.acquire()
        t1 = clock()
        lock.release()
        t2 = clock()
        finished(OK, t2 - t0, t1 - t0, t2 - t1, 4, 4096, None)

    return call


def fold_in(metrics: EngineMetrics) -> Callable[[int], None]:
    """Folding buffered records into the accumulators (what a full buffer or a scrape does), per record."""
    apply = metrics.path(sc.PATH_SEND)._apply
    records = [(OK, duration, wait, hold, 4, 4096, None) for duration, wait, hold in VALUES[:1000]]
    flat = [value for record in records for value in record]  # as a thread's buffer holds them

    def run(n: int) -> None:
        for _ in range(max(1, n // 1000)):
            apply(list(flat))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()

    plain_lock = threading.Lock()

    def with_lock() -> None:
        with plain_lock:
            pass

    reg = CollectorRegistry()
    hist = Histogram("h_seconds", "h", ["a"], registry=reg, buckets=sc.DEFAULT_LATENCY_BUCKETS).labels("x")
    counter = Counter("c", "c", ["a"], registry=reg).labels("x")
    noop_tracer = otel_trace.NoOpTracerProvider().get_tracer("bench")
    hand_lock = threading.Lock()

    def hand_stacked() -> None:
        with hand_lock, hist.time(), noop_tracer.start_as_current_span("write_back"):
            pass

    ours = CollectorRegistry()
    families = MetricFamilies.of(ours)
    metrics = EngineMetrics(families, "bench", "cache")
    buffered = metrics.path(sc.PATH_SEND).finished
    eager = PathMetrics(families, "eager", "cache", sc.PATH_SEND, metrics.failures).finished
    theirs = prometheus_finished(CollectorRegistry())
    fold_metrics = EngineMetrics(MetricFamilies.of(CollectorRegistry()), "fold", "cache")
    scrape_registry = CollectorRegistry()
    EngineMetrics(MetricFamilies.of(scrape_registry), "scrape", "cache")

    def scrape(n: int) -> None:
        for _ in range(max(1, n // 1000)):
            for _ in scrape_registry.collect():
                pass

    cases = {
        "with threading.Lock()": loop(with_lock),
        "hand-stacked: lock + Histogram.time() + no-op span": loop(hand_stacked),
        "issue prototype: lock + clocks + bisect into arrays + outcome count": loop(issue_prototype()),
        "prometheus_client Counter.inc": loop(counter.inc),
        "kvobs counter child inc": loop(metrics.signals[sc.SIGNAL_READY].inc),
        "prometheus_client Histogram.observe": loop(lambda: hist.observe(0.0001)),
        "kvobs histogram child observe": loop(lambda: metrics.signal_buffered.observe(0.0001)),
        "prometheus_client children doing finished()'s updates": finishing(theirs),
        "kvobs finished(), eager on kvobs children": finishing(eager),
        "kvobs finished(), buffered (batches folded in included)": finishing(buffered),
        "prometheus_client children doing finished()'s updates, with exemplar": finishing(theirs, EXEMPLAR),
        "kvobs finished(), buffered, with exemplar": finishing(buffered, EXEMPLAR),
        "recording call: lock + clocks + finished()": loop(recording_call(buffered)),
        "fold-in of a 1000-record batch, per record": fold_in(fold_metrics),
        "one scrape of an observer's families, per 1000 calls": scrape,
    }
    rounds = rounds_ns(cases, args.n, args.repeats)
    print(f"median of {args.repeats} interleaved rounds of {args.n} calls per case; ratios: median of the "
          "ratios taken within each round\n")
    print("| case | ns per call |")
    print("| --- | ---: |")
    for name, value in medians(rounds).items():
        print(f"| {name} | {value:,.0f} |")
    print()
    print("| target | ratio | limit |")
    print("| --- | ---: | ---: |")
    for name, ratio, limit in per_round(ratios, rounds):
        verdict = "-" if limit is None else f"{limit:.2f} {'met' if ratio <= limit else 'MISSED'}"
        print(f"| {name} | {ratio:.2f} | {verdict} |")


def ratios(ns: dict[str, float]) -> list[tuple[str, float, float | None]]:
    """(name, ratio, limit or None) of one round."""
    bare = ns["with threading.Lock()"]
    stacked = ns["hand-stacked: lock + Histogram.time() + no-op span"]
    call = ns["recording call: lock + clocks + finished()"]
    prototype = ns["issue prototype: lock + clocks + bisect into arrays + outcome count"]
    buffered = ns["kvobs finished(), buffered (batches folded in included)"]
    return [
        ("recording call / hand-stacked", call / stacked, 0.3),
        ("recording call / with threading.Lock()", call / bare, 3.0),
        ("issue prototype / hand-stacked (reference)", prototype / stacked, 0.3),
        ("issue prototype / with threading.Lock() (reference)", prototype / bare, 3.0),
        ("finished() buffered / prometheus_client children, same updates",
         buffered / ns["prometheus_client children doing finished()'s updates"], None),
        ("finished() buffered / eager on kvobs children", buffered / ns["kvobs finished(), eager on kvobs children"],
         None),
        ("kvobs counter child / prometheus_client Counter.inc",
         ns["kvobs counter child inc"] / ns["prometheus_client Counter.inc"], None),
        ("kvobs histogram child / prometheus_client Histogram.observe",
         ns["kvobs histogram child observe"] / ns["prometheus_client Histogram.observe"], None),
    ]

if __name__ == "__main__":
    main()
