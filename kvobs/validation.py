"""Argument checks that run before the lock is touched, so a bad call can never leak or hold it."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from kvobs.errors import TransferRejected


def block_id_list(path: str, block_ids: Any) -> list[int]:
    """Block ids as a list of Python ints: lists, tuples, ranges, numpy arrays and 1-D integer tensors."""
    if isinstance(block_ids, (str, bytes)) or not hasattr(block_ids, "__len__"):
        raise TransferRejected(path, f"block ids must be a sequence of ints, got {type(block_ids).__name__}")
    tolist = getattr(block_ids, "tolist", None)
    if tolist is not None and not isinstance(block_ids, (list, tuple)):
        if getattr(block_ids, "ndim", 1) != 1:
            raise TransferRejected(path, f"block ids must be one-dimensional, got shape {tuple(block_ids.shape)}")
        block_ids = tolist()
    if all(type(b) is int for b in block_ids):
        return block_ids if isinstance(block_ids, list) else list(block_ids)
    ids = []
    for b in block_ids:
        if isinstance(b, bool):
            raise TransferRejected(path, f"block id {b!r} is a bool, not an int")
        try:
            ids.append(operator.index(b))
        except TypeError:
            raise TransferRejected(path, f"block id {b!r} is a {type(b).__name__}, not an int") from None
    return ids


def validate_transfer(
    path: str,
    keys: Any,
    block_ids: Any,
    is_sync: Any,
    *,
    sync_required: bool,
    capacity: int | None,
) -> list[int] | None:
    """Raise TransferRejected naming the first problem; return the block ids as ints (None when not given)."""
    if is_sync is not None and sync_required:
        if not isinstance(is_sync, bool):
            raise TransferRejected(path, f"is_sync must be a bool, got {type(is_sync).__name__} {is_sync!r}")
        if not is_sync:
            raise TransferRejected(
                path,
                "asynchronous transfers are not supported on this path (is_sync=False); "
                "the cache lock would be released before the transfer completes",
            )
    if keys is not None and (isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence)):
        raise TransferRejected(path, f"keys must be a sequence of storage keys, got {type(keys).__name__}")
    if block_ids is None:
        return None
    ids = block_id_list(path, block_ids)
    if keys is not None and len(keys) != len(ids):
        raise TransferRejected(path, f"{len(keys)} storage keys but {len(ids)} block ids; they must pair up")
    if ids and min(ids) < 0:
        raise TransferRejected(path, f"block id {min(ids)} is negative")
    if capacity is not None and ids and max(ids) >= capacity:
        raise TransferRejected(path, f"block id {max(ids)} is out of range for a cache of {capacity} blocks")
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        dup = next(b for b in ids if b in seen or seen.add(b))
        raise TransferRejected(path, f"block id {dup} appears more than once")
    return ids
