"""Per-call overhead of kvobs's guarded transfers, against baselines measured in the same run.

    python benchmarks/overhead.py [--n 20000] [--repeats 9]

Prints ns per call and the ratios the targets of issue 11 are stated in (met or missed): a metrics-only
guarded call (a decorator naming nothing in the call: the fast lane) against a bare `with threading.Lock():`
and against the lock + `Histogram.time()` + span a user would stack by hand, and beside it a decorator
naming block ids (the general lifecycle: validation, block counts); a batch of 64 requests per request; a
recording span against the raw SDK span with the same attributes; and the explicit begin + complete
against the decorator.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from prometheus_client import CollectorRegistry, Histogram

import kvobs
from _timing import ns_per_op
from kvobs import semconv as sc

BATCH = 64


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


def observer(name: str, **options: object) -> kvobs.KVObserver:
    return kvobs.KVObserver(name, registry=CollectorRegistry(), integrity=None, **options)


def decorated(obs: kvobs.KVObserver) -> Callable[[], None]:
    @obs.write_back()
    def noop() -> None:
        return None

    return noop


def baselines() -> dict[str, Callable[[int], None]]:
    plain_lock = threading.Lock()
    hist = Histogram("h_seconds", "h", ["a"], registry=CollectorRegistry(), buckets=sc.DEFAULT_LATENCY_BUCKETS)
    child = hist.labels("x")
    noop_tracer = otel_trace.NoOpTracerProvider().get_tracer("bench")

    def with_lock() -> None:
        with plain_lock:
            pass

    def hand_stacked() -> None:
        with plain_lock, child.time(), noop_tracer.start_as_current_span("write_back"):
            pass

    return {"with threading.Lock()": loop(with_lock),
            "hand-stacked: lock + Histogram.time() + no-op span": loop(hand_stacked)}


def kvobs_cases(providers: dict[str, TracerProvider]) -> dict[str, Callable[[int], None]]:
    metrics_only = observer("m")
    begin = metrics_only.begin

    def begin_complete() -> None:
        begin(sc.PATH_WRITE_BACK).complete()

    batch_obs = observer("b")
    requests = {f"req-{i}": [i] for i in range(BATCH)}

    @batch_obs.send(requests="reqs")
    def send_batch(reqs: dict[str, list[int]]) -> None:
        return None

    raw_tracer = providers["raw"].get_tracer("bench")
    start_attrs = {sc.ATTR_ENGINE: "r", sc.ATTR_PATH: "write_back", sc.ATTR_LOCK_NAME: "thread"}
    end_attrs = {sc.ATTR_LOCK_WAIT_S: 1e-6, sc.ATTR_LOCK_HOLD_S: 1e-6, sc.ATTR_OUTCOME: "ok", sc.ATTR_BYTES: 0}

    def raw_span() -> None:
        span = raw_tracer.start_span("kvobs.write_back", attributes=start_attrs)
        span.set_attributes(end_attrs)
        span.end()

    blocks_obs = observer("g")
    ids = [1, 2, 3, 4]

    @blocks_obs.write_back(block_ids="block_ids")
    def write_blocks(block_ids: list[int]) -> None:
        return None

    return {
        "kvobs metrics only (decorator)": loop(decorated(metrics_only)),
        "kvobs metrics only, decorator naming block_ids (general lifecycle)": loop(lambda: write_blocks(ids)),
        "kvobs metrics only (obs.begin + t.complete)": loop(begin_complete),
        f"kvobs metrics only, batch of {BATCH} requests (one call)": loop(lambda: send_batch(requests)),
        "raw SDK span with kvobs's attributes (not current)": loop(raw_span),
        "kvobs + SDK tracing, recording": loop(decorated(observer("r", tracer_provider=providers["recording"]))),
        "kvobs + SDK tracing, sampled off": loop(decorated(observer("s", tracer_provider=providers["off"]))),
        "kvobs disabled (lock and fast lane, no telemetry)": loop(decorated(observer("d", enabled=False))),
    }


def targets(ns: dict[str, float]) -> list[tuple[str, float, float]]:
    metrics = ns["kvobs metrics only (decorator)"]
    return [
        ("metrics only / hand-stacked", metrics / ns["hand-stacked: lock + Histogram.time() + no-op span"], 0.3),
        ("metrics only / bare with threading.Lock()", metrics / ns["with threading.Lock()"], 3.0),
        (f"batch of {BATCH}: us per request", ns[f"kvobs metrics only, batch of {BATCH} requests (one call)"]
         / BATCH / 1000, 1.0),
        ("recording / (raw SDK span with the same attributes + metrics only)",
         ns["kvobs + SDK tracing, recording"] / (ns["raw SDK span with kvobs's attributes (not current)"] + metrics),
         1.15),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    providers = {"raw": sdk_provider(True), "recording": sdk_provider(True), "off": sdk_provider(False)}
    cases = {**baselines(), **kvobs_cases(providers)}
    ns = ns_per_op(cases, args.n, args.repeats)
    for provider in providers.values():
        provider.shutdown()
    print("| case | ns per call |")
    print("| --- | ---: |")
    for name, value in ns.items():
        print(f"| {name} | {value:,.0f} |")
    print()
    print("| target | measured | limit |")
    print("| --- | ---: | ---: |")
    for name, value, limit in targets(ns):
        print(f"| {name} | {value:.2f} | {limit:.2f} {'met' if value <= limit else 'MISSED'} |")
    begin_vs_decorator = ns["kvobs metrics only (obs.begin + t.complete)"] / ns["kvobs metrics only (decorator)"]
    print(f"\nobs.begin + t.complete / decorator: {begin_vs_decorator:.2f}")


if __name__ == "__main__":
    main()
