"""Throughput of kvobs.integrity.check_blocks against the naive check, t.sum(), and its own torch path.

Usage: python benchmarks/integrity.py [--device cpu|cuda] [--repeats 9] [--threads N]

GB/s = bytes of the checked blocks / median wall time (warm-up first). Every timed call starts cold: a
256 MiB scratch buffer is read first (untimed), so no contender finds its bytes in the CPU caches left by
the previous round (the hosts of this machine class can have L3 caches larger than the 32 MiB selections).
On CPU that read is NumPy's (one thread, no OpenMP), followed by a pause longer than OpenMP's spin-wait:
a torch read would leave torch's OpenMP threads spinning for about 10 ms, pre-woken for t.sum() and
holding a core that kvobs's own second thread needs. Every contender starts with its helper threads
parked, as after a transfer that waited on a device or the network.
Contenders that read in place are interleaved round by round, so that noise from other processes hits them
alike; the ones that allocate a copy per call (the naive check, gathers) run apart, in fewer rounds, so
that their page faults do not land on the others.
- kvobs: `check_blocks(validated_cache, ids)` as the guard runs it (compiled kernel on CPU when numba is
  installed, else the torch path);
- kvobs torch path: the same check forced onto the pure-torch path (`method="torch"`);
- isfinite: `isfinite(x).all()`, the naive check; sum: `x.sum()`, no check at all, the usual yardstick.
On random blocks, isfinite and "gather + sum" first gather the blocks (`cache[ids]`, the natural user code);
"t.sum()" there is `sum()` over a contiguous slab of the same size, and the next row checks 256 adjacent
blocks of the same cache. The target lines compare ratios measured in this run.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from kvobs.integrity import check_blocks, validate_cache

MiB = 1 << 20
BLOCK_SHAPE = (64, 8, 128)  # tokens per block, kv heads, head dim
NUM_BLOCKS = 4096
RANDOM_BLOCKS = 256
SCRATCH_BYTES = 256 * MiB
OPENMP_SPIN_S = 0.02  # longer than libgomp's spin-wait after a parallel region (about 10 ms measured)


def measure(fns: dict[str, Callable[[], object]], nbytes: int, device: str, repeats: int) -> dict[str, float]:
    """GB/s per contender: median over `repeats` interleaved rounds, each call after a cache eviction."""
    scratch = _scratch(device)

    def once(fn: Callable[[], object]) -> float:
        scratch()  # untimed: evicts the caches, then lets every thread pool park
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        once(fn)  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(once(fn))
    return {name: nbytes / statistics.median(ts) / 1e9 for name, ts in times.items()}


@functools.cache
def _scratch(device: str) -> Callable[[], object]:
    """A call that reads SCRATCH_BYTES (see the module docstring for why NumPy and a pause on CPU)."""
    buffer = torch.ones(SCRATCH_BYTES, dtype=torch.uint8, device=device)
    if device != "cpu":
        return lambda: buffer.max().item()
    array = buffer.numpy()
    return lambda: (array.max(), time.sleep(OPENMP_SPIN_S))


def row(case: str, nbytes: int, kvobs: float, torch_path: float | None, isfinite: float, total: float) -> str:
    cells = [
        case,
        f"{nbytes // MiB} MiB",
        f"{kvobs:.2f}",
        "-" if torch_path is None else f"{torch_path:.2f}",
        f"{isfinite:.2f}",
        f"{total:.2f}",
        f"{kvobs / total:.0%}",
        f"{kvobs / isfinite:.0f}x",
        "-" if torch_path is None else f"{kvobs / torch_path:.1f}x",
    ]
    return f"| {' | '.join(cells)} |"


def checks(validated: object, ids: list[int]) -> dict[str, Callable[[], object]]:
    """kvobs as the guard runs it, and forced onto the torch path where the kernel is what it runs."""
    fns: dict[str, Callable[[], object]] = {"kvobs": lambda: check_blocks(validated, ids)}
    if "kernel" in validated.methods:  # type: ignore[attr-defined]
        fns["kvobs torch path"] = lambda: check_blocks(validated, ids, method="torch")
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (kvobs splits checks over as many)")
    args = parser.parse_args()
    device, reps, naive_reps = args.device, args.repeats, max(1, args.repeats // 3)
    if args.threads:
        torch.set_num_threads(args.threads)

    probe = validate_cache(torch.ones(1, 1, device=device))
    print(
        f"torch {torch.__version__}, device {device}, torch threads {torch.get_num_threads()}, median of {reps} "
        f"(naive check: {naive_reps}); kvobs reads {device} tensors with: {probe.methods[0]}\n"
    )
    print("| case | size | kvobs GB/s | kvobs torch path GB/s | isfinite().all() GB/s | t.sum() GB/s "
          "| kvobs/sum | kvobs/isfinite | kvobs/torch path |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    targets: list[tuple[str, float, float]] = []

    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn):
        for size in (64 * MiB, 512 * MiB) if dtype in (torch.bfloat16, torch.float16) else (64 * MiB,):
            elements = size // torch.empty((), dtype=dtype).element_size()
            t = torch.ones(elements, dtype=torch.float32, device=device).to(dtype).view(-1, *BLOCK_SHAPE)
            wide = t.to(torch.float16) if dtype == torch.float8_e4m3fn else t  # torch has no fp8 sum/isfinite
            fns = checks(validate_cache(t), list(range(t.shape[0])))
            fns["sum"] = lambda wide=wide: wide.sum().item()
            gbps = measure(fns, size, device, reps)
            naive = measure({"isfinite": lambda wide=wide: torch.isfinite(wide).all().item()}, size, device, naive_reps)
            name = str(dtype).removeprefix("torch.")
            print(row(f"whole tensor, {name}", size, gbps["kvobs"], gbps.get("kvobs torch path"),
                      naive["isfinite"], gbps["sum"]), flush=True)
            if dtype in (torch.bfloat16, torch.float16):
                targets.append((f"whole tensor {name} {size // MiB} MiB: kvobs >= 100% of t.sum()",
                                gbps["kvobs"] / gbps["sum"], 1.0))
            del t, wide

    cache = torch.ones(NUM_BLOCKS, *BLOCK_SHAPE, dtype=torch.bfloat16, device=device)
    validated = validate_cache(cache)
    ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0))[:RANDOM_BLOCKS].tolist()
    index = torch.tensor(ids, device=device)
    adjacent = list(range(NUM_BLOCKS // 2, NUM_BLOCKS // 2 + RANDOM_BLOCKS))
    same_size = cache[:RANDOM_BLOCKS]
    nbytes = RANDOM_BLOCKS * cache[0].numel() * cache.element_size()
    fns = checks(validated, ids)
    fns["kvobs, adjacent"] = lambda: check_blocks(validated, adjacent)
    fns["sum"] = lambda: same_size.sum().item()
    gbps = measure(fns, nbytes, device, reps)
    gathers = {
        "isfinite": lambda: torch.isfinite(cache[index]).all().item(),
        "gather + sum": lambda: cache[index].sum().item(),
    }
    naive = measure(gathers, nbytes, device, naive_reps)
    shape = ", ".join(map(str, BLOCK_SHAPE))
    print(row(f"{RANDOM_BLOCKS} random blocks of [{NUM_BLOCKS}, {shape}] bf16", nbytes, gbps["kvobs"],
              gbps.get("kvobs torch path"), naive["isfinite"], gbps["sum"]))
    print(row(f"{RANDOM_BLOCKS} adjacent blocks of the same cache", nbytes, gbps["kvobs, adjacent"], None,
              naive["isfinite"], gbps["sum"]))
    targets += [
        ("random blocks: kvobs >= 90% of kvobs on adjacent blocks", gbps["kvobs"] / gbps["kvobs, adjacent"], 0.9),
        ("random blocks: kvobs >= 100% of t.sum() over as many contiguous bytes", gbps["kvobs"] / gbps["sum"], 1.0),
        ("random blocks: kvobs >= 100% of gather + t.sum()", gbps["kvobs"] / naive["gather + sum"], 1.0),
    ]
    print(f"\ngather + sum over the random blocks: {naive['gather + sum']:.2f} GB/s\n")
    print("| target | measured | met |")
    print("| --- | --- | --- |")
    for text, ratio, goal in targets:
        print(f"| {text} | {ratio:.0%} | {'met' if ratio >= goal else 'missed'} |")


if __name__ == "__main__":
    main()
