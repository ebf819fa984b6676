"""Block ids for `check_blocks` (read by `kvobs._runtime.ids`, as everywhere in kvobs) -> sorted distinct ids as
the int64 array the kernel reads, checked against the cache; and runs of adjacent ids for the library paths.

The errors are those of a public function: TypeError for what is not an integer, ValueError for a meta
tensor, IndexError naming an id outside the cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

import kvobs.integrity._kernel as kernel
from kvobs._runtime.ids import BOOL, META, NONE, NOT_AN_INT, NOT_ITERABLE, BadIds, int_list


def id_array(block_ids: Iterable[int] | Any, num_blocks: int) -> np.ndarray:
    """Sorted distinct ids as a writable int64 array; TypeError for non-integers, IndexError (naming the id)
    for ids outside the cache. Any iterable of ints or int array (NumPy, torch, Paddle) of any shape."""
    try:
        ints = int_list(block_ids, ordered=False)
    except BadIds as exc:
        raise _public_error(exc) from None
    try:
        ids = np.array(ints, dtype=np.int64)
    except OverflowError:  # beyond int64 is beyond any cache: the range check raises
        _check_range([min(ints), max(ints)], num_blocks)
        raise
    ids = kernel.distinct_sorted(ids)
    if ids.shape[0] and not (ids[0] >= 0 and ids[-1] < num_blocks):
        _check_range([int(ids[0]), int(ids[-1])], num_blocks)
    return ids


def _public_error(exc: BadIds) -> Exception:
    """check_blocks's own wording and error type for ids `kvobs._runtime.ids` refused."""
    if exc.problem == META:
        return ValueError(str(exc))
    if exc.problem == BOOL:
        return TypeError(f"block ids must be integers, got {exc.value!r}")
    if exc.problem == NOT_AN_INT:
        return TypeError(f"block ids must be integers, got {exc.value!r} ({type(exc.value).__name__})")
    if exc.problem in (NONE, NOT_ITERABLE):
        return TypeError(f"block ids must be an iterable of ints, got {exc.value!r}")
    return TypeError(str(exc))


def _check_range(extremes: list[int], num_blocks: int) -> None:
    for i in extremes:
        if not 0 <= i < num_blocks:
            raise IndexError(f"block id {i} out of range: the cache has {num_blocks} blocks (ids 0..{num_blocks - 1})")


def runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct ids (at least one) -> (start, length) runs of consecutive ids."""
    found: list[tuple[int, int]] = []
    start = prev = ids[0]
    for i in ids[1:]:
        if i != prev + 1:
            found.append((start, prev - start + 1))
            start = i
        prev = i
    found.append((start, prev - start + 1))
    return found
