"""Block ids as any sequence of ints, NumPy/torch/DLPack int arrays -> sorted distinct ids, validated.

Why a fast path: a check of a few hundred blocks after a transfer starts with cold CPU caches, where every
Python-level step costs tens of microseconds. A list or tuple of plain ints (what engines and the guard
pass) is converted by NumPy in one call and sorted in place by the compiled kernel; everything else goes
through the general path, which names the first bad value.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import numpy as np

import kvobs.integrity._kernel as kernel
from kvobs.integrity._arrays import from_dlpack, installed_torch, is_torch_tensor

_PLAIN = {int}  # exactly int: bool (a subclass) is rejected, NumPy ints take the general path


def id_array(block_ids: Iterable[int] | Any, num_blocks: int) -> np.ndarray:
    """Sorted distinct ids as a writable int64 array; TypeError for non-integers, IndexError (naming the id)
    for ids outside the cache."""
    ids = _plain_ints(block_ids)
    if ids is None:
        return np.array(normalize_ids(block_ids, num_blocks), dtype=np.int64)
    ids = kernel.distinct_sorted(ids)
    if ids.shape[0] and not (ids[0] >= 0 and ids[-1] < num_blocks):
        _check_range([int(ids[0]), int(ids[-1])], num_blocks)
    return ids


def normalize_ids(block_ids: Iterable[int] | Any, num_blocks: int) -> list[int]:
    """Sorted distinct ids; TypeError for non-integers, IndexError (naming the id) for ids outside the cache."""
    ordered = sorted(_distinct_ints(block_ids))
    _check_range(ordered[:1] + ordered[-1:], num_blocks)
    return ordered


def _plain_ints(block_ids: Any) -> np.ndarray | None:
    """A list or tuple of plain ints as an int64 array; None for anything else (or ints beyond int64)."""
    if type(block_ids) not in (list, tuple) or not set(map(type, block_ids)) <= _PLAIN:
        return None
    try:
        return np.array(block_ids, dtype=np.int64)
    except OverflowError:  # beyond int64: the general path names it as out of range
        return None


def _check_range(extremes: list[int], num_blocks: int) -> None:
    for i in extremes:
        if not 0 <= i < num_blocks:
            raise IndexError(f"block id {i} out of range: the cache has {num_blocks} blocks (ids 0..{num_blocks - 1})")


def _distinct_ints(block_ids: Any) -> set[int]:
    raw = _array_to_list(block_ids)
    if raw is None and not isinstance(block_ids, Iterable):
        raise TypeError(f"block ids must be an iterable of ints, got {block_ids!r}")
    ids = set()
    for i in block_ids if raw is None else raw:
        if isinstance(i, bool):
            raise TypeError(f"block ids must be integers, got {i!r}")
        try:
            ids.add(operator.index(i))
        except TypeError:
            raise TypeError(f"block ids must be integers, got {i!r} ({type(i).__name__})") from None
    return ids


def _array_to_list(block_ids: Any) -> list[Any] | None:
    """The ids of a torch tensor, NumPy array or any DLPack array (Paddle, CuPy) as a flat list; else None."""
    if not isinstance(block_ids, np.ndarray) and not is_torch_tensor(block_ids):
        if not hasattr(block_ids, "__dlpack__"):
            return None
        block_ids = from_dlpack(block_ids, "block ids")
    if isinstance(block_ids, np.ndarray):
        if block_ids.dtype.kind not in "iu":
            raise TypeError(f"block ids must be integers, got a {block_ids.dtype} array")
        return block_ids.reshape(-1).tolist()
    if block_ids.is_meta:  # torch would raise NotImplementedError from tolist()
        raise ValueError("block ids are a meta tensor: it holds no values to read")
    if block_ids.is_floating_point() or block_ids.is_complex() or block_ids.dtype == installed_torch().bool:
        raise TypeError(f"block ids must be integers, got a {block_ids.dtype} tensor")
    return block_ids.reshape(-1).tolist()


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
