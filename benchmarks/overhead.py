"""Per-call overhead of a kvobs-decorated function that does nothing, against baselines from the same run.

    python benchmarks/overhead.py [--n 20000] [--repeats 9]

Prints a markdown table of ns per call and the ratios the targets are stated in.
"""

from __future__ import annotations

import argparse
import functools
import threading
from collections import deque
import time
from collections.abc import Callable

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

import kvobs
from _timing import ns_per_op
from kvobs import semconv as sc
from kvobs.telemetry.logs import trace_fields
from kvobs.telemetry.metrics import EngineMetrics, MetricFamilies, observe


class DroppingExporter(SpanExporter):
    """Accepts every batch and keeps nothing: the SDK's cost without any I/O."""

    def export(self, spans):  # noqa: D102
        return SpanExportResult.SUCCESS


def sdk_provider(recording: bool) -> TracerProvider:
    provider = TracerProvider(sampler=None if recording else ALWAYS_OFF)
    provider.add_span_processor(BatchSpanProcessor(DroppingExporter(), max_queue_size=65536))
    return provider


def loop(fn: Callable[[], object]) -> Callable[[int], None]:
    def run(n: int) -> None:
        for _ in range(n):
            fn()

    return run


def decorated(observer: kvobs.KVObserver) -> Callable[[], None]:
    @observer.write_back()
    def noop() -> None:
        return None

    return noop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    def bare() -> None:
        return None

    @functools.wraps(bare)
    def wrapped() -> None:
        return bare()

    plain_lock = threading.Lock()

    def with_lock() -> None:
        with plain_lock:
            bare()

    reg = CollectorRegistry()
    hist = Histogram("h_seconds", "h", ["a"], registry=reg, buckets=sc.DEFAULT_LATENCY_BUCKETS).labels("x")
    counter = Counter("c", "c", ["a"], registry=reg).labels("x")
    gauge = Gauge("g", "g", ["a"], registry=reg).labels("x")
    noop_tracer = otel_trace.NoOpTracerProvider().get_tracer("bench")
    hand_lock = threading.Lock()

    def hand_stacked() -> None:
        with hand_lock, hist.time(), noop_tracer.start_as_current_span("write_back"):
            bare()

    raw_provider = sdk_provider(recording=True)
    raw_tracer = raw_provider.get_tracer("bench")

    def raw_span() -> None:
        raw_tracer.start_span("kvobs.write_back").end()

    # The span kvobs records: the same name and attributes, set at start and at end.
    start_attrs = {sc.ATTR_ENGINE: "r", sc.ATTR_PATH: "write_back", sc.ATTR_LOCK_NAME: "thread"}

    def raw_span_same_attributes() -> None:
        span = raw_tracer.start_span("kvobs.write_back", attributes=start_attrs)
        span.set_attributes({sc.ATTR_LOCK_WAIT_S: 1e-6, sc.ATTR_LOCK_HOLD_S: 1e-6, sc.ATTR_OUTCOME: "ok"})
        span.end()

    # ... and made current, as kvobs does so that engine spans nest under it and logs carry its trace id.
    def raw_current_span_same_attributes() -> None:
        with raw_tracer.start_as_current_span("kvobs.write_back", attributes=start_attrs) as span:
            span.set_attributes({sc.ATTR_LOCK_WAIT_S: 1e-6, sc.ATTR_LOCK_HOLD_S: 1e-6, sc.ATTR_OUTCOME: "ok"})

    kv_lock = kvobs.ThreadLock()
    running: deque[None] = deque()

    def lock_pair() -> None:
        kv_lock.acquire(30.0)
        kv_lock.release()

    @functools.wraps(bare)
    def wrapper_and_lock() -> None:
        kv_lock.acquire(30.0)
        try:
            return bare()
        finally:
            kv_lock.release()

    # The same work kvobs does when recording, written out by hand with no abstraction: what a user could
    # at best write themselves (span + context, lock, in-flight, 3 histograms with 2 exemplars, counter).
    hand_metrics = EngineMetrics(MetricFamilies.of(CollectorRegistry()), "hand", "thread").paths["write_back"]
    hand_tracer = sdk_provider(recording=True).get_tracer("bench")

    def hand_written_recording() -> None:
        span = hand_tracer.start_span("kvobs.write_back", attributes=start_attrs)
        token = otel_context.attach(otel_trace.set_span_in_context(span))
        t0 = time.perf_counter()
        kv_lock.acquire(30.0)
        t1 = time.perf_counter()
        hand_metrics.in_flight.start()
        bare()
        kv_lock.release()
        t2 = time.perf_counter()
        hand_metrics.in_flight.finish()
        exemplar = trace_fields(span)
        observe(hand_metrics.lock_wait, t1 - t0, exemplar)
        observe(hand_metrics.duration["ok"], t2 - t0, exemplar)
        hand_metrics.lock_hold.observe(t2 - t1)
        hand_metrics.transfers["ok"].inc()
        span.set_attributes({sc.ATTR_LOCK_WAIT_S: t1 - t0, sc.ATTR_LOCK_HOLD_S: t2 - t1, sc.ATTR_OUTCOME: "ok"})
        otel_context.detach(token)
        span.end()

    metrics_only = decorated(kvobs.KVObserver("m", registry=CollectorRegistry(), integrity=None))
    sampled_off_provider = sdk_provider(recording=False)
    sampled_off = decorated(kvobs.KVObserver("s", registry=CollectorRegistry(), integrity=None,
                                             tracer_provider=sampled_off_provider))
    recording_provider = sdk_provider(recording=True)
    recording = decorated(kvobs.KVObserver("r", registry=CollectorRegistry(), integrity=None,
                                           tracer_provider=recording_provider))
    disabled = decorated(kvobs.KVObserver("d", registry=CollectorRegistry(), integrity=None, enabled=False))

    cases = {
        "bare call": loop(bare),
        "functools.wraps wrapper": loop(wrapped),
        "with threading.Lock()": loop(with_lock),
        "hand-stacked: lock + Histogram.time() + no-op span": loop(hand_stacked),
        "primitive: kvobs lock pair": loop(lock_pair),
        "primitive: Histogram.observe (cached child)": loop(lambda: hist.observe(0.0001)),
        "primitive: Counter.inc": loop(counter.inc),
        "primitive: Gauge.inc": loop(gauge.inc),
        "primitive: clock read": loop(time.perf_counter),
        "primitive: raw SDK span (batch, dropping exporter)": loop(raw_span),
        "primitive: raw SDK span with kvobs's attributes": loop(raw_span_same_attributes),
        "primitive: raw SDK current span (start_as_current_span) with kvobs's attributes":
            loop(raw_current_span_same_attributes),
        "primitive: deque append + pop (in-flight count)": loop(lambda: (running.append(None), running.pop())),
        "wraps wrapper + lock pair": loop(wrapper_and_lock),
        "kvobs metrics only": loop(metrics_only),
        "kvobs + SDK tracing, sampled off": loop(sampled_off),
        "kvobs + SDK tracing, recording": loop(recording),
        "hand-written equivalent of kvobs recording": loop(hand_written_recording),
        "kvobs disabled": loop(disabled),
    }
    ns = ns_per_op(cases, args.n, args.repeats)
    for provider in (raw_provider, sampled_off_provider, recording_provider):
        provider.shutdown()

    # What metrics-only performs per call: the lock pair, 3 histogram observes (wait, hold, duration),
    # 1 counter (transfers), the in-flight deque append + pop, 4 clock reads (call start, lock acquired,
    # call end, and the once-a-second tracer-provider check's monotonic clock).
    primitives = (ns["primitive: kvobs lock pair"] + 3 * ns["primitive: Histogram.observe (cached child)"]
                  + ns["primitive: Counter.inc"] + ns["primitive: deque append + pop (in-flight count)"]
                  + 4 * ns["primitive: clock read"])
    print("| case | ns per call |")
    print("| --- | ---: |")
    for name, value in ns.items():
        print(f"| {name} | {value:,.0f} |")
    print(f"| sum of primitives kvobs performs (metrics only) | {primitives:,.0f} |")
    print()
    print("| target | ratio | limit |")
    print("| --- | ---: | ---: |")
    rows = [
        ("metrics only / sum of its primitives", ns["kvobs metrics only"] / primitives, 1.3),
        ("metrics only / hand-stacked", ns["kvobs metrics only"] / ns["hand-stacked: lock + Histogram.time() + no-op span"], 1.0),
        ("recording / (raw SDK current span with the same attributes + metrics only)",
         ns["kvobs + SDK tracing, recording"]
         / (ns["primitive: raw SDK current span (start_as_current_span) with kvobs's attributes"]
            + ns["kvobs metrics only"]), 1.15),
        ("recording / (raw SDK span with the same attributes + metrics only)", ns["kvobs + SDK tracing, recording"]
         / (ns["primitive: raw SDK span with kvobs's attributes"] + ns["kvobs metrics only"]), 1.15),
        ("recording / (bare raw SDK span + metrics only)", ns["kvobs + SDK tracing, recording"]
         / (ns["primitive: raw SDK span (batch, dropping exporter)"] + ns["kvobs metrics only"]), 1.15),
        ("recording / hand-written equivalent of the same work", ns["kvobs + SDK tracing, recording"]
         / ns["hand-written equivalent of kvobs recording"], 1.15),
        ("disabled / (wraps wrapper + lock pair)", ns["kvobs disabled"] / ns["wraps wrapper + lock pair"], 1.5),
    ]
    for name, ratio, limit in rows:
        print(f"| {name} | {ratio:.2f} | {limit:.2f} {'ok' if ratio <= limit else 'MISSED'} |")


if __name__ == "__main__":
    main()
