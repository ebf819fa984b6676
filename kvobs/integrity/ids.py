"""Block ids as any sequence of ints, NumPy/torch/DLPack int arrays -> sorted distinct ints, validated."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any


def normalize_ids(block_ids: Iterable[int] | Any, num_blocks: int) -> list[int]:
    """Sorted distinct ids; TypeError for non-integers, IndexError (naming the id) for ids outside the cache."""
    ordered = sorted(_distinct_ints(block_ids))
    for i in ordered[:1] + ordered[-1:]:
        if not 0 <= i < num_blocks:
            raise IndexError(f"block id {i} out of range: the cache has {num_blocks} blocks (ids 0..{num_blocks - 1})")
    return ordered


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
    import numpy as np
    import torch

    if isinstance(block_ids, np.ndarray):
        if block_ids.dtype.kind not in "iu":
            raise TypeError(f"block ids must be integers, got a {block_ids.dtype} array")
        return block_ids.reshape(-1).tolist()
    if not isinstance(block_ids, torch.Tensor):
        if not hasattr(block_ids, "__dlpack__"):
            return None
        block_ids = torch.from_dlpack(block_ids)
    if block_ids.is_floating_point() or block_ids.is_complex() or block_ids.dtype == torch.bool:
        raise TypeError(f"block ids must be integers, got a {block_ids.dtype} tensor")
    return block_ids.reshape(-1).tolist()
