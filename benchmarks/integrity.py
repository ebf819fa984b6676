"""Throughput of kvobs.integrity.check_blocks against the naive check, t.sum(), and its own torch path.

Usage: python benchmarks/integrity.py [--device cpu|cuda] [--repeats 7] [--threads N]

GB/s = bytes of the checked blocks / median wall time (warm-up first; contenders interleaved round by round
so that noise from other processes hits them alike). Contenders:
- kvobs: `check_blocks(validated_cache, ids)` as the guard runs it (compiled kernel on CPU when numba is
  installed, else the torch path);
- kvobs torch: the same check forced onto the pure-torch path (`method="torch"`);
- isfinite: `isfinite(x).all()`, the naive check; sum: `x.sum()`, no check at all, the usual yardstick.
On random blocks, isfinite/sum first gather the blocks (`cache[ids]`, the natural user code); "sum, same
size" is `sum()` over a contiguous slab of the same size, and "kvobs, contiguous" checks 256 adjacent blocks.
The target lines compare ratios measured in this run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kvobs.integrity import check_blocks, validate_cache

MiB = 1 << 20
BLOCK_SHAPE = (64, 8, 128)  # tokens per block, kv heads, head dim
NUM_BLOCKS = 4096
RANDOM_BLOCKS = 256
NAIVE_EVERY = 3  # the naive check is ~50x slower: it runs every third round only


def measure(fns: dict[str, Callable[[], object]], nbytes: int, device: str, repeats: int) -> dict[str, float]:
    """GB/s per contender: median over `repeats` interleaved rounds."""

    def once(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        once(fn)  # warm-up
    for rnd in range(repeats):
        for name, fn in fns.items():
            if name != "isfinite" or rnd % NAIVE_EVERY == 0:
                times[name].append(once(fn))
    return {name: nbytes / statistics.median(ts) / 1e9 for name, ts in times.items()}


def contenders(cache: torch.Tensor, ids: list[int], gathered: Callable[[], torch.Tensor]) -> dict[str, Callable[[], object]]:
    validated = validate_cache(cache)
    fns: dict[str, Callable[[], object]] = {"kvobs": lambda: check_blocks(validated, ids)}
    if "kernel" in validated.methods:
        fns["kvobs torch"] = lambda: check_blocks(validated, ids, method="torch")
    fns["isfinite"] = lambda: torch.isfinite(gathered()).all().item()
    fns["sum"] = lambda: gathered().sum().item()
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (kvobs splits checks over as many)")
    args = parser.parse_args()
    device, reps = args.device, args.repeats
    if args.threads:
        torch.set_num_threads(args.threads)

    probe = validate_cache(torch.ones(1, 1, device=device))
    print(
        f"torch {torch.__version__}, device {device}, torch threads {torch.get_num_threads()}, "
        f"median of {reps}; kvobs reads {device} tensors with: {probe.methods[0]}\n"
    )
    print("| case | size | kvobs GB/s | kvobs torch path GB/s | isfinite().all() GB/s | t.sum() GB/s "
          "| kvobs/sum | kvobs/isfinite | kvobs/torch path |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    targets: list[tuple[str, float, float]] = []

    def show(case: str, nbytes: int, kvobs: float, gbps: dict[str, float], sum_key: str = "sum") -> None:
        torch_path = gbps.get("kvobs torch")
        cells = [
            case,
            f"{nbytes // MiB} MiB",
            f"{kvobs:.2f}",
            "-" if torch_path is None else f"{torch_path:.2f}",
            f"{gbps['isfinite']:.2f}",
            f"{gbps[sum_key]:.2f}",
            f"{kvobs / gbps[sum_key]:.0%}",
            f"{kvobs / gbps['isfinite']:.0f}x",
            "-" if torch_path is None else f"{kvobs / torch_path:.1f}x",
        ]
        print(f"| {' | '.join(cells)} |", flush=True)

    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn):
        for size in (64 * MiB, 512 * MiB) if dtype in (torch.bfloat16, torch.float16) else (64 * MiB,):
            elements = size // torch.empty((), dtype=dtype).element_size()
            t = torch.ones(elements, dtype=torch.float32, device=device).to(dtype).view(-1, *BLOCK_SHAPE)
            fns = contenders(t, list(range(t.shape[0])), lambda t=t: t)
            if dtype == torch.float8_e4m3fn:  # torch has no fp8 isfinite/sum: the yardsticks run on fp16
                wide = t.to(torch.float16)
                fns["isfinite"] = lambda: torch.isfinite(wide).all().item()
                fns["sum"] = lambda: wide.sum().item()
            gbps = measure(fns, size, device, reps)
            name = str(dtype).removeprefix("torch.")
            show(f"whole tensor, {name}", size, gbps["kvobs"], gbps)
            if dtype in (torch.bfloat16, torch.float16):
                targets.append((f"whole tensor {name} {size // MiB} MiB: kvobs >= 100% of t.sum()",
                                gbps["kvobs"] / gbps["sum"], 1.0))

    cache = torch.ones(NUM_BLOCKS, *BLOCK_SHAPE, dtype=torch.bfloat16, device=device)
    ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0))[:RANDOM_BLOCKS].tolist()
    index = torch.tensor(ids, device=device)
    adjacent = list(range(NUM_BLOCKS // 2, NUM_BLOCKS // 2 + RANDOM_BLOCKS))
    same_size = cache[:RANDOM_BLOCKS]
    validated = validate_cache(cache)
    fns = contenders(cache, ids, lambda: cache[index])
    fns["kvobs, contiguous"] = lambda: check_blocks(validated, adjacent)
    fns["sum, same size"] = lambda: same_size.sum().item()
    nbytes = RANDOM_BLOCKS * cache[0].numel() * cache.element_size()
    gbps = measure(fns, nbytes, device, reps)
    case = f"{RANDOM_BLOCKS} random blocks of [{NUM_BLOCKS}, {', '.join(map(str, BLOCK_SHAPE))}] bf16"
    show(case, nbytes, gbps["kvobs"], gbps, sum_key="sum, same size")
    show(f"{RANDOM_BLOCKS} adjacent blocks of the same cache", nbytes, gbps["kvobs, contiguous"],
         {name: v for name, v in gbps.items() if name != "kvobs torch"}, sum_key="sum, same size")
    targets += [
        ("random blocks: kvobs >= 90% of kvobs on contiguous blocks", gbps["kvobs"] / gbps["kvobs, contiguous"], 0.9),
        ("random blocks: kvobs >= 100% of t.sum() over the same bytes (contiguous)",
         gbps["kvobs"] / gbps["sum, same size"], 1.0),
        ("random blocks: kvobs >= 100% of gather + t.sum()", gbps["kvobs"] / gbps["sum"], 1.0),
    ]
    print(f"\nsum over the gathered random blocks: {gbps['sum']:.2f} GB/s; "
          f"over a contiguous slab of the same size: {gbps['sum, same size']:.2f} GB/s\n")
    print("| target | measured | met |")
    print("| --- | --- | --- |")
    for text, ratio, goal in targets:
        print(f"| {text} | {ratio:.0%} | {'met' if ratio >= goal else 'missed'} |")


if __name__ == "__main__":
    main()
