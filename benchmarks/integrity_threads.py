"""Where the CPU NaN check's read rate comes from: one thread against two, 4 KiB pages against huge pages.

Usage: python benchmarks/integrity_threads.py [--repeats 9] [--passes 3]

Why: `benchmarks/integrity.py` compares the check with `t.sum()`, which reads with torch's OpenMP threads.
This script runs both at 1 and at 2 intra-op threads (the check splits itself over `torch.get_num_threads()`
threads), on the same 256 random blocks and on a contiguous slab of as many bytes, and once more on a copy of
the cache allocated by NumPy, which Linux backs with transparent huge pages where it is allowed to (so a
page walk covers 2 MiB instead of 4 KiB). Timing as in `benchmarks/integrity.py` (every call starts with cold
caches and parked threads); each thread count is measured in its own block, the blocks alternated `passes`
times, and the medians over passes are printed.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from integrity import BLOCK_SHAPE, MiB, NUM_BLOCKS, RANDOM_BLOCKS, measure
from kvobs.integrity import check_blocks, validate_cache


def huge_page_copy(cache: torch.Tensor) -> torch.Tensor:
    """`cache` copied into NumPy-allocated memory (NumPy asks for huge pages for large arrays)."""
    words = np.empty(cache.numel(), dtype=np.uint16)
    copy = torch.from_numpy(words).view(torch.bfloat16).view(cache.shape)
    copy.copy_(cache)
    return copy


def contenders(cache: torch.Tensor, huge: torch.Tensor, ids: list[int]) -> dict[str, object]:
    validated, validated_huge = validate_cache(cache), validate_cache(huge)
    slab, huge_slab = cache[:RANDOM_BLOCKS], huge[:RANDOM_BLOCKS]
    return {
        "kvobs, random blocks": lambda: check_blocks(validated, ids),
        "t.sum(), contiguous slab": lambda: slab.sum().item(),
        "kvobs, random blocks, huge pages": lambda: check_blocks(validated_huge, ids),
        "t.sum(), contiguous slab, huge pages": lambda: huge_slab.sum().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    cache = torch.ones(NUM_BLOCKS, *BLOCK_SHAPE, dtype=torch.bfloat16)
    huge = huge_page_copy(cache)
    ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0))[:RANDOM_BLOCKS].tolist()
    nbytes = RANDOM_BLOCKS * cache[0].numel() * cache.element_size()
    fns = contenders(cache, huge, ids)
    threads = (1, 2)
    samples: dict[tuple[str, int], list[float]] = {(name, n): [] for name in fns for n in threads}
    for _ in range(args.passes):
        for n in threads:
            torch.set_num_threads(n)
            for name, gbps in measure(fns, nbytes, "cpu", args.repeats).items():  # type: ignore[arg-type]
                samples[name, n].append(gbps)
    gbps = {key: statistics.median(values) for key, values in samples.items()}
    print(f"{nbytes // MiB} MiB per call, GB/s (median of {args.passes} passes of {args.repeats} cold calls)\n")
    print("| contender | 1 thread | 2 threads | 2 / 1 |")
    print("| --- | ---: | ---: | ---: |")
    for name in fns:
        one, two = gbps[name, 1], gbps[name, 2]
        print(f"| {name} | {one:.1f} | {two:.1f} | {two / one:.2f}x |")
    print()
    for n in threads:
        for pages in ("", ", huge pages"):
            ratio = gbps[f"kvobs, random blocks{pages}", n] / gbps[f"t.sum(), contiguous slab{pages}", n]
            print(f"kvobs on random blocks / t.sum() on a slab, {n} thread(s){pages or ', 4 KiB pages'}: {ratio:.0%}")


if __name__ == "__main__":
    main()
