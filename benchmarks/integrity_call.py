"""The NaN/Inf check of a small transfer as the lifecycle calls it, against the compiled kernel calls alone.

    python benchmarks/integrity_call.py [--blocks 5] [--tensors 2] [--block-kib 16] [--n 2000] [--repeats 9]
                                        [--cold 200]

A transfer of a few blocks (vLLM's offloading moves a handful per request) is checked where the lifecycle checks it:
`replacement` (kvobs/_lifecycle/checks.py) on an open prefetch of `--blocks` scattered blocks, over a cache of
`--tensors` CPU float32 tensors (vLLM's layout: one tensor per layer, blocks along dim 0), policy `skip`, metrics
recorded. The yardstick, measured in the same run: the compiled kernel calls alone (`KernelPlan.mark` once per
tensor on ids already in an int64 array, flags and counters allocated once and reset), the least any check of
these blocks does.
- warm: round-robin rounds of `--n` calls each (benchmarks/_timing.py); the ratio is the median of the ratios
  taken within each round;
- cold: before every call 64 MiB are read (NumPy, one thread), as inside a running engine, where a transfer's
  check finds the CPU caches full of the model's data; the median of `--cold` calls of each, alternated.
Needs numba (the compiled kernel); the cache is read on one thread (a small check never uses the pool).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from _timing import medians, per_round, rounds_ns

import kvobs
from kvobs import semconv as sc
from kvobs._lifecycle import checks
from kvobs.integrity import validate_cache
from kvobs.policy import IntegrityPolicy

EVICT_BYTES = 64 << 20


def contenders(blocks: int, tensors: int, block_kib: int) -> tuple[dict[str, Callable[[], object]], Callable[[], object]]:
    """(the two calls by name, the finishing call that completes the open transfer)."""
    num_blocks = 2000
    cache = [torch.ones(num_blocks, block_kib * 256) for _ in range(tensors)]  # float32: 4 bytes per value
    ids = [10 * k + 3 for k in range(blocks)]  # scattered, as a request's blocks are
    obs = kvobs.KVObserver("bench", lock=None, deadline=600.0, integrity=IntegrityPolicy("skip"))
    t = obs.begin(sc.PATH_PREFETCH, key="bench", block_ids=ids, cache=cache)
    plans, rest = validate_cache(cache).split("auto")
    if rest or len(plans) != tensors:
        raise SystemExit("the compiled kernel is not available here (pip install 'kvobs[fast]')")
    id_array = np.array(sorted(ids), dtype=np.int64)
    flags = np.zeros(blocks, dtype=np.uint8)
    counters = np.zeros(tensors, dtype=np.int64)
    counter_views = [counters[i : i + 1] for i in range(tensors)]

    def kernel_alone() -> None:
        counters.fill(0)
        for plan, counter in zip(plans, counter_views):
            plan.mark(id_array, flags, counter)

    def lifecycle() -> object:
        return checks.replacement(t, t.blocks, can_replace=True)

    if lifecycle() is not checks.UNSET:
        raise SystemExit("the benchmark's cache is not clean")
    return {"kernel calls alone": kernel_alone, "check as the lifecycle calls it": lifecycle}, t.complete


def warm(fns: dict[str, Callable[[], object]], n: int, repeats: int) -> tuple[dict[str, float], float]:
    def looped(fn: Callable[[], object]) -> Callable[[int], None]:
        def run(count: int) -> None:
            for _ in range(count):
                fn()
        return run

    rounds = rounds_ns({name: looped(fn) for name, fn in fns.items()}, n, repeats)
    kernel, lifecycle = fns
    (ratio,) = [row[1] for row in per_round(lambda ns: [("ratio", ns[lifecycle] / ns[kernel])], rounds)]
    return medians(rounds), ratio


def cold(fns: dict[str, Callable[[], object]], calls: int) -> dict[str, float]:
    scratch = np.ones(EVICT_BYTES // 8)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(calls):
        for name, fn in fns.items():
            scratch.sum()  # untimed: the CPU caches now hold the scratch buffer, not kvobs's code and data
            start = time.perf_counter_ns()
            fn()
            times[name].append(time.perf_counter_ns() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--tensors", type=int, default=2)
    parser.add_argument("--block-kib", type=int, default=16, help="KiB per block per tensor")
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--cold", type=int, default=200, help="cold calls of each contender")
    args = parser.parse_args()
    torch.set_num_threads(1)
    fns, finish = contenders(args.blocks, args.tensors, args.block_kib)
    nbytes = args.blocks * args.tensors * args.block_kib
    print(f"{args.blocks} blocks x {args.tensors} tensors ({nbytes} KiB), kvobs from {kvobs.__file__}\n")
    warm_ns, warm_ratio = warm(fns, args.n, args.repeats)
    cold_ns = cold(fns, args.cold)
    kernel, lifecycle = fns
    print("| case | warm us | cold us |")
    print("| --- | --- | --- |")
    for name in fns:
        print(f"| {name} | {warm_ns[name] / 1000:.1f} | {cold_ns[name] / 1000:.1f} |")
    print(f"| lifecycle / kernel alone | {warm_ratio:.1f}x | {cold_ns[lifecycle] / cold_ns[kernel]:.1f}x |")
    finish()


if __name__ == "__main__":
    main()
