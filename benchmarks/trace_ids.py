"""Trace and span ids: kvobs's per-process generator against the SDK's default, per id and per span.

The SDK's default (RandomIdGenerator) draws from the global `random`, which applications seed alike in every
process; kvobs's draws from a private `random.Random` seeded from os.urandom (reseeded after fork). os.urandom
per id is shown for reference: the obvious alternative, a system call per id. Ratios are taken within each
round against the SDK's default (benchmarks/_timing.py).

    .venv/bin/python benchmarks/trace_ids.py [--n 200000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from _timing import medians, per_round, rounds_ns
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

from kvobs.telemetry._trace_ids import UNIQUE_IDS


class UrandomIdGenerator(IdGenerator):
    """Reference only: a system call per id."""

    def generate_span_id(self) -> int:
        return int.from_bytes(os.urandom(8), "big") or 1

    def generate_trace_id(self) -> int:
        return int.from_bytes(os.urandom(16), "big") or 1


GENERATORS: dict[str, IdGenerator] = {
    "SDK default (global random)": RandomIdGenerator(),
    "kvobs (private Random, reseeded after fork)": UNIQUE_IDS,
    "os.urandom per id (reference)": UrandomIdGenerator(),
}


def ids_case(generator: IdGenerator) -> Callable[[int], None]:
    """One trace id and one span id per operation: what a root span draws."""

    def run(n: int) -> None:
        trace_id, span_id = generator.generate_trace_id, generator.generate_span_id
        for _ in range(n):
            trace_id()
            span_id()

    return run


def span_case(generator: IdGenerator) -> Callable[[int], None]:
    """A root span started and ended on an SDK provider (no processor) with `generator`."""
    tracer = TracerProvider(id_generator=generator).get_tracer("bench")

    def run(n: int) -> None:
        start = tracer.start_span
        for _ in range(n):
            start("kvobs.send").end()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000, help="operations per case per round")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    cases = {}
    for name, generator in GENERATORS.items():
        cases[f"ids: {name}"] = ids_case(generator)
        cases[f"span: {name}"] = span_case(generator)
    rounds = rounds_ns(cases, args.n, args.rounds)
    print("| case | ns per op |\n| --- | ---: |")
    for name, ns in medians(rounds).items():
        print(f"| {name} | {ns:,.0f} |")
    default = next(iter(GENERATORS))

    def ratios(ns: dict[str, float]) -> list[tuple[str, float]]:
        return [(f"{kind}: {name} / SDK default", ns[f"{kind}: {name}"] / ns[f"{kind}: {default}"])
                for kind in ("ids", "span") for name in GENERATORS if name != default]

    print("\n| ratio (per round, median) | value |\n| --- | ---: |")
    for name, ratio in per_round(ratios, rounds):
        print(f"| {name} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
