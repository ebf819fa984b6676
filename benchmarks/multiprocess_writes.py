"""Multiprocess mode: what kvobs's space check costs per write, against prometheus_client's child written bare.

kvobs writes its multiprocess series through CounterSeries / HistogramSeries (kvobs/telemetry/_metrics/multiprocess.py),
which first check that this process's files have their space (a full directory would otherwise kill it with
SIGBUS). Ratios are taken within each round (benchmarks/_timing.py). Runs in a temporary
PROMETHEUS_MULTIPROC_DIR of its own, set before prometheus_client is imported.

    .venv/bin/python benchmarks/multiprocess_writes.py [--n 100000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import tempfile

_DIR = tempfile.TemporaryDirectory(prefix="kvobs-bench-mp-")
os.environ["PROMETHEUS_MULTIPROC_DIR"] = _DIR.name

from _timing import medians, per_round, rounds_ns  # noqa: E402
from prometheus_client import Counter, Histogram  # noqa: E402 - after the variable, as multiprocess mode needs

from kvobs.telemetry._metrics.multiprocess import ReservedMetric  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="writes per case per round")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    counter = Counter("bench_writes", "writes", ["engine"], registry=None)
    histogram = Histogram("bench_seconds", "seconds", ["engine"], registry=None)
    bare_counter, bare_histogram = counter.labels("bare"), histogram.labels("bare")
    kvobs_counter = ReservedMetric(counter, "counter", "bench_writes", "writes", ["engine"]).labels("kvobs")
    kvobs_histogram = ReservedMetric(histogram, "histogram", "bench_seconds", "seconds", ["engine"],
                                     buckets=Histogram.DEFAULT_BUCKETS).labels("kvobs")

    def incs(child):
        def run(n: int) -> None:
            inc = child.inc
            for _ in range(n):
                inc()
        return run

    def observes(child):
        def run(n: int) -> None:
            observe = child.observe
            for _ in range(n):
                observe(0.003)
        return run

    cases = {"counter inc, prometheus_client child": incs(bare_counter),
             "counter inc, kvobs CounterSeries": incs(kvobs_counter),
             "histogram observe, prometheus_client child": observes(bare_histogram),
             "histogram observe, kvobs HistogramSeries": observes(kvobs_histogram)}
    rounds = rounds_ns(cases, args.n, args.rounds)
    print("| case | ns per write |\n| --- | ---: |")
    for name, ns in medians(rounds).items():
        print(f"| {name} | {ns:,.0f} |")

    def ratios(ns: dict[str, float]) -> list[tuple[str, float]]:
        return [(f"{kind}: kvobs / bare", ns[f"{kind}, kvobs {cls}"] / ns[f"{kind}, prometheus_client child"])
                for kind, cls in (("counter inc", "CounterSeries"), ("histogram observe", "HistogramSeries"))]

    print("\n| ratio (per round, median) | value |\n| --- | ---: |")
    for name, ratio in per_round(ratios, rounds):
        print(f"| {name} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
