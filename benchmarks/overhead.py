"""Per-call overhead of kvobs's guarded transfers, against baselines measured in the same run.

    python benchmarks/overhead.py [--n 2000] [--repeats 60]

Prints ns per call and the ratios the targets of issue 11 are stated in (met or missed): a metrics-only
guarded call (a decorator naming nothing in the call: the fast lane) against a bare `with threading.Lock():`
and against the lock + `Histogram.time()` + span a user would stack by hand, and beside it a decorator
naming block ids, and keys too (the fast lane, validating them), and one naming KV groups (the general
lifecycle); a batch of 64 requests per request; a recording span against the raw SDK span with the same
attributes, and a sampled-off one against the raw sampled-off span; and the explicit begin + complete against
the decorator, also as the engine integrations call it (under a key, with a request id and 16 block ids,
completed by key), and exactly as the vLLM integration calls it per transfer (`check=`, a key, a request id, 16
block ids, their bytes and a small cache whose sources are checked, or the check sampled out; then
`open_transfer` by key and `complete`). Cases run round-robin, a few thousand calls each per round; a ratio is the median of the
ratios taken within each round, steadier on a shared machine than the ratio of two medians.
"""

from __future__ import annotations

import argparse
import itertools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from _timing import medians, per_round, rounds_ns
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from prometheus_client import CollectorRegistry, Histogram

import kvobs
from kvobs import semconv as sc
from kvobs.policy import IntegrityPolicy

BATCH = 64
INTEGRATION_CHECKED = ("kvobs metrics only, as the vLLM integration calls it: begin(check, key, request_id, 16 block_ids, "
                       "cache, nbytes) + open_transfer + complete, sources checked")
INTEGRATION_UNCHECKED = INTEGRATION_CHECKED.replace("sources checked", "check sampled out")


class DroppingExporter(SpanExporter):
    """Accepts every batch and keeps nothing: the SDK's cost without any I/O."""

    def export(self, spans):  # noqa: D102
        return SpanExportResult.SUCCESS


def sdk_provider(recording: bool, batch: bool = True) -> TracerProvider:
    """`batch`: the BatchSpanProcessor of a deployment (its export thread competes for the GIL and the two
    cores, which makes the tracing ratio swing between runs); else a SimpleSpanProcessor, which does the same
    work on the calling thread, so only the per-call cost is compared."""
    provider = TracerProvider(sampler=None if recording else ALWAYS_OFF)
    exporter = DroppingExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=65536) if batch
                                else SimpleSpanProcessor(exporter))
    return provider


def loop(fn: Callable[[], object]) -> Callable[[int], None]:
    def run(n: int) -> None:
        for _ in range(n):
            fn()

    return run


def flushed(run: Callable[[int], None], provider: TracerProvider) -> Callable[[int], None]:
    """`run`, then the spans it queued exported: each case pays for exporting its own spans. Without it the
    batch processor's worker exports the leftovers of one case while the next runs, and the case timed right
    after the raw batch span pays for both (docs/benchmarks.md, "Tracing")."""

    def run_and_flush(n: int) -> None:
        run(n)
        provider.force_flush()

    return run_and_flush


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

    request_ids = [f"req-{i}" for i in range(1024)]
    sixteen = list(range(16))
    engine_shaped_obs = observer("e")
    keyed_begin = engine_shaped_obs.begin
    keyed_complete = engine_shaped_obs.complete
    turn = itertools.count()

    def engine_shaped() -> None:
        """What the engine integrations do: begin under a request's key, complete by key (later, elsewhere)."""
        rid = request_ids[next(turn) & 1023]
        keyed_begin(sc.PATH_SEND, key=rid, request_id=rid, block_ids=sixteen)
        keyed_complete(sc.PATH_SEND, rid)

    integration_obs = kvobs.KVObserver("i", registry=CollectorRegistry(), integrity="raise")
    reported = IntegrityPolicy("skip", skip_result=None)  # the integrations' default `report` mode
    small_cache = np.zeros((64, 2, 16, 8), dtype=np.float16)
    block_bytes = small_cache[0].nbytes

    def as_integrations_call(check: Any) -> Callable[[], None]:
        """What `kvobs.integrations.vllm._transfers.Transfers` does per transfer: begin under a key with a request
        id, 16 block ids, their bytes and the cache to check (or `check=False` for a transfer the sampler
        leaves out), then find it by key and complete it."""

        def begin_find_complete() -> None:
            rid = request_ids[next(turn) & 1023]
            integration_obs.begin(sc.PATH_WRITE_BACK, check=check, key=rid, request_id=rid, block_ids=sixteen,
                                  group_sizes=None, cache=small_cache, nbytes=16 * block_bytes, trace_context=None)
            integration_obs.open_transfer(sc.PATH_WRITE_BACK, rid).complete()

        return begin_find_complete

    batch_obs = observer("b")
    requests = {f"req-{i}": [i] for i in range(BATCH)}

    @batch_obs.send(requests="reqs")
    def send_batch(reqs: dict[str, list[int]]) -> None:
        return None

    blocks_obs = observer("g")
    keyed_obs = observer("k")
    grouped_obs = observer("q")
    ids = [1, 2, 3, 4]
    keys = ["k1", "k2", "k3", "k4"]

    @blocks_obs.write_back(block_ids="block_ids")
    def write_blocks(block_ids: list[int]) -> None:
        return None

    @keyed_obs.write_back(keys="keys", block_ids="block_ids")
    def write_keyed(keys: list[str], block_ids: list[int]) -> None:
        return None

    @grouped_obs.write_back(block_ids="block_ids", group_sizes="groups")
    def write_grouped(block_ids: list[int], groups: list[int]) -> None:
        return None

    return {
        "kvobs metrics only (decorator)": loop(decorated(metrics_only)),
        "kvobs metrics only, decorator naming 4 block_ids (fast lane)": loop(lambda: write_blocks(ids)),
        "kvobs metrics only, decorator naming 4 keys and 4 block_ids (fast lane)": loop(lambda: write_keyed(keys, ids)),
        "kvobs metrics only, decorator naming 4 block_ids in one KV group (general lifecycle)":
            loop(lambda: write_grouped(ids, [4])),
        "kvobs metrics only (obs.begin + t.complete)": loop(begin_complete),
        "kvobs metrics only, obs.begin(key, request_id, 16 block_ids) + obs.complete(path, key) (engine integrations)":
            loop(engine_shaped),
        INTEGRATION_CHECKED: loop(as_integrations_call(reported)),
        INTEGRATION_UNCHECKED: loop(as_integrations_call(False)),
        f"kvobs metrics only, batch of {BATCH} requests (one call)": loop(lambda: send_batch(requests)),
        **tracing_cases(providers),
        "kvobs disabled (lock and fast lane, no telemetry)": loop(decorated(observer("d", enabled=False))),
    }


def tracing_cases(providers: dict[str, TracerProvider]) -> dict[str, Callable[[int], None]]:
    """The raw SDK span with kvobs's attributes against a recording kvobs call, per span processor."""
    start_attrs = {sc.ATTR_ENGINE: "r", sc.ATTR_PATH: "write_back", sc.ATTR_LOCK_NAME: "thread"}
    end_attrs = {sc.ATTR_LOCK_WAIT_S: 1e-6, sc.ATTR_LOCK_HOLD_S: 1e-6, sc.ATTR_OUTCOME: "ok", sc.ATTR_BYTES: 0}

    def raw_span(tracer: Any) -> Callable[[], None]:
        def span_once() -> None:
            span = tracer.start_span("kvobs.write_back", attributes=start_attrs)
            span.set_attributes(end_attrs)
            span.end()

        return span_once

    cases = {}
    for processor in ("batch", "simple"):
        raw_provider = providers[f"raw {processor}"]
        kvobs_provider = providers[f"recording {processor}"]
        cases[f"raw SDK span with kvobs's attributes (not current), {processor} processor"] = flushed(
            loop(raw_span(raw_provider.get_tracer("bench"))), raw_provider)
        kvobs_obs = observer(f"r-{processor}", tracer_provider=kvobs_provider)
        cases[f"kvobs + SDK tracing, recording, {processor} processor"] = flushed(
            loop(decorated(kvobs_obs)), kvobs_provider)
    raw_off = providers["raw off"].get_tracer("bench")
    cases["raw SDK span with kvobs's attributes, sampled off"] = loop(raw_span(raw_off))
    cases["kvobs + SDK tracing, sampled off"] = loop(decorated(observer("s", tracer_provider=providers["off"])))
    return cases


def targets(ns: dict[str, float]) -> list[tuple[str, float, float]]:
    metrics = ns["kvobs metrics only (decorator)"]
    return [
        ("metrics only / hand-stacked", metrics / ns["hand-stacked: lock + Histogram.time() + no-op span"], 0.3),
        ("metrics only / bare with threading.Lock()", metrics / ns["with threading.Lock()"], 3.0),
        (f"batch of {BATCH}: us per request", ns[f"kvobs metrics only, batch of {BATCH} requests (one call)"]
         / BATCH / 1000, 1.0),
        *[(f"recording / (raw SDK span with the same attributes + metrics only), {processor} processor",
           ns[f"kvobs + SDK tracing, recording, {processor} processor"]
           / (ns[f"raw SDK span with kvobs's attributes (not current), {processor} processor"] + metrics), 1.15)
          for processor in ("batch", "simple")],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    providers = {f"{role} {processor}": sdk_provider(True, batch=processor == "batch")
                 for role in ("raw", "recording") for processor in ("batch", "simple")}
    providers["off"] = sdk_provider(False)
    providers["raw off"] = sdk_provider(False)
    cases = {**baselines(), **kvobs_cases(providers)}
    rounds = rounds_ns(cases, args.n, args.repeats)
    for provider in providers.values():
        provider.shutdown()
    print(f"median of {args.repeats} interleaved rounds of {args.n} calls per case; ratios: median of the "
          "ratios taken within each round\n")
    print("| case | ns per call |")
    print("| --- | ---: |")
    for name, value in medians(rounds).items():
        print(f"| {name} | {value:,.0f} |")
    print()
    print("| target | measured | limit |")
    print("| --- | ---: | ---: |")
    for name, value, limit in per_round(targets, rounds):
        print(f"| {name} | {value:.3f} | {limit:.2f} {'met' if value <= limit else 'MISSED'} |")
    print()
    for name, value in per_round(comparisons, rounds):
        print(f"{name}: {value:.2f}")


def comparisons(ns: dict[str, float]) -> list[tuple[str, float]]:
    """Ratios printed for reference, with no target."""
    metrics = ns["kvobs metrics only (decorator)"]
    raw_off = ns["raw SDK span with kvobs's attributes, sampled off"]
    return [
        ("obs.begin + t.complete / decorator", ns["kvobs metrics only (obs.begin + t.complete)"] / metrics),
        ("sampled off / (raw SDK span sampled off + metrics only)",
         ns["kvobs + SDK tracing, sampled off"] / (raw_off + metrics)),
        ("as the vLLM integration calls it, sources checked / bare with threading.Lock()",
         ns[INTEGRATION_CHECKED] / ns["with threading.Lock()"]),
        ("as the vLLM integration calls it, check sampled out / bare with threading.Lock()",
         ns[INTEGRATION_UNCHECKED] / ns["with threading.Lock()"]),
    ]

if __name__ == "__main__":
    main()
