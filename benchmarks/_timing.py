"""Shared timing helper: interleaved repetitions, medians in ns per operation (noisy shared machines)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable


def ns_per_op(cases: dict[str, Callable[[int], None]], n: int, repeats: int = 9) -> dict[str, float]:
    """Run every case `repeats` times, round-robin so machine noise hits all alike; median ns per op.

    Each case is `run(n)`, performing its operation n times.
    """
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for run in cases.values():
        run(max(1, n // 10))  # warm-up
    gc.disable()
    try:
        for _ in range(repeats):
            for name, run in cases.items():
                t0 = time.perf_counter_ns()
                run(n)
                samples[name].append((time.perf_counter_ns() - t0) / n)
    finally:
        gc.enable()
    return {name: statistics.median(values) for name, values in samples.items()}
