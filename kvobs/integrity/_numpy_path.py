"""The NumPy path: CPU arrays where torch is not installed and the compiled kernel is not either (or declines).

Why bits, not `isfinite`: NumPy has no bfloat16 or fp8 of its own (ml_dtypes adds them), and `isfinite`
materialises a bool per element. Each value's bits read as an unsigned key `(bits & mask) ^ flip` (see
`kvobs.integrity._bits`) make a block's largest key say exactly whether it holds a NaN, an Inf, or neither, for
every format. Runs of adjacent blocks are read at most `CHUNK_ELEMENTS` elements at a time, so the temporary
keys stay small whatever the cache's size; the cache itself is never written.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvobs.integrity._bits import non_finite_bits
from kvobs.integrity._ids import runs

CHUNK_ELEMENTS = 1 << 22  # 4 Mi elements: a 16 MiB key temporary for fp32

_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bad_blocks(arrays: Sequence[np.ndarray], ids: list[int], block_dim: int) -> tuple[set[int], set[int]]:
    """(NaN block ids, non-finite block ids) among `ids` (sorted, distinct, in range) of these arrays."""
    nan: set[int] = set()
    bad: set[int] = set()
    for array in arrays:
        bits = non_finite_bits(array.dtype)
        words = _WORDS[bits.width]
        mask = words(bits.mask)
        flip = words(bits.flip)
        blocks = np.moveaxis(array, block_dim % array.ndim, 0)
        per_chunk = max(1, CHUNK_ELEMENTS // (array.size // blocks.shape[0]))
        for start, length in runs(ids):
            for first in range(start, start + length, per_chunk):
                count = min(per_chunk, start + length - first)
                keys = np.ascontiguousarray(blocks[first : first + count]).view(words).reshape(count, -1) & mask
                keys ^= flip
                largest = keys.max(axis=1)
                nan.update((first + np.flatnonzero(largest >= bits.nan_min)).tolist())
                bad.update((first + np.flatnonzero(largest >= bits.bad_min)).tolist())
    return nan, bad
