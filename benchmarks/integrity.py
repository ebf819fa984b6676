"""Throughput of kvobs.integrity.check_blocks against the naive check and the read ceiling.

Usage: python benchmarks/integrity.py [--device cpu|cuda] [--repeats 7]

Prints a markdown table. GB/s = bytes of the checked blocks / median time (warm-up first). Baselines:
`isfinite(t).all()` (the naive check) and `t.sum()` (the read ceiling; no valid check). On the random-block
case the baselines are the natural user code, `cache[ids]` gather then isfinite().all() / sum(); the
"read ceiling" column there is `sum()` over a contiguous tensor of the same size as the selected blocks.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kvobs.integrity import check_blocks

MiB = 1 << 20
BLOCK_SHAPE = (64, 8, 128)  # tokens per block, kv heads, head dim
NUM_BLOCKS = 4096
RANDOM_BLOCKS = 256


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str) -> float:
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def row(case: str, nbytes: int, fns: dict[str, Callable[[], object]], device: str, repeats: int) -> str:
    """Interleave the contenders round by round, so that noise from other processes hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():
        timed(fn, device)  # warm-up
    for rnd in range(repeats):
        for name, fn in fns.items():
            if name != "isfinite" or rnd % 3 == 0:  # the naive check is ~50x slower: fewer rounds
                times[name].append(timed(fn, device))
    gbps = {name: nbytes / statistics.median(ts) / 1e9 for name, ts in times.items()}
    gbps.setdefault("ceiling", gbps["sum"])
    return (
        f"| {case} | {nbytes // MiB} MiB | {gbps['kvobs']:.2f} | {gbps['isfinite']:.2f} | {gbps['sum']:.2f} "
        f"| {gbps['ceiling']:.2f} | {gbps['kvobs'] / gbps['ceiling']:.0%} "
        f"| {gbps['kvobs'] / gbps['isfinite']:.0f}x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device, reps = args.device, args.repeats

    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, median of {reps}\n")
    print(
        "| case | size | kvobs GB/s | isfinite().all() GB/s | t.sum() GB/s | read ceiling GB/s "
        "| kvobs/ceiling | kvobs/isfinite |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.bfloat16, torch.float16):
        for size in (64 * MiB, 512 * MiB):
            t = torch.ones(size // 2, dtype=dtype, device=device).view(-1, *BLOCK_SHAPE)
            everything = range(t.shape[0])
            print(
                row(
                    f"whole tensor, {str(dtype).removeprefix('torch.')}",
                    size,
                    {
                        "kvobs": lambda: check_blocks(t, everything),
                        "isfinite": lambda: torch.isfinite(t).all().item(),
                        "sum": lambda: t.sum().item(),
                    },
                    device,
                    reps,
                ),
                flush=True,
            )

    cache = torch.ones(NUM_BLOCKS, *BLOCK_SHAPE, dtype=torch.bfloat16, device=device)
    ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0))[:RANDOM_BLOCKS].tolist()
    index = torch.tensor(ids, device=device)
    same_size = cache[:RANDOM_BLOCKS]
    print(
        row(
            f"{RANDOM_BLOCKS} random blocks of [{NUM_BLOCKS}, {', '.join(map(str, BLOCK_SHAPE))}] bf16",
            RANDOM_BLOCKS * cache[0].numel() * cache.element_size(),
            {
                "kvobs": lambda: check_blocks(cache, ids),
                "isfinite": lambda: torch.isfinite(cache[index]).all().item(),
                "sum": lambda: cache[index].sum().item(),
                "ceiling": lambda: same_size.sum().item(),
            },
            device,
            reps,
        )
    )


if __name__ == "__main__":
    main()
