"""Shared timing helper: interleaved rounds, ns per operation, and ratios taken within each round (noisy shared
machines: a slow moment slows both sides of a ratio measured in the same round, so its median is steadier
than the ratio of two medians)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

Row = TypeVar("Row", bound=tuple)


def rounds_ns(cases: dict[str, Callable[[int], None]], n: int, repeats: int = 9) -> list[dict[str, float]]:
    """Run every case once per round, `repeats` rounds, round-robin so machine noise hits all alike; ns per op
    of each case in each round. Each case is `run(n)`, performing its operation n times."""
    for run in cases.values():
        run(max(1, n // 10))  # warm-up
    rounds: list[dict[str, float]] = []
    gc.disable()
    try:
        for _ in range(repeats):
            timed = {}
            for name, run in cases.items():
                t0 = time.perf_counter_ns()
                run(n)
                timed[name] = (time.perf_counter_ns() - t0) / n
            rounds.append(timed)
    finally:
        gc.enable()
    return rounds


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Median ns per op of every case over the rounds."""
    return {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}


def per_round(rows: Callable[[dict[str, float]], list[Row]], rounds: list[dict[str, float]]) -> list[Row]:
    """`rows(ns)` (tuples whose second item is a ratio) computed in every round; each row's median ratio."""
    computed = [rows(r) for r in rounds]
    return [(*first[:1], statistics.median(c[i][1] for c in computed), *first[2:])  # type: ignore[misc]
            for i, first in enumerate(computed[0])]
