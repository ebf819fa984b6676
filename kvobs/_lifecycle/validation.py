"""Argument checks that run before the lock is touched, so a bad call can never leak or hold it.

They accept what real engines pass and still reject what is wrong:

- FastDeploy builds storage keys for *full* blocks only while it allocates ceil(tokens / block_size)
  blocks, so a transfer may carry one key fewer than block ids (the partial last block has no key);
- vLLM's hybrid models list the same block ids once per KV-cache group (`[9, 10, 9, 10]` with
  `group_sizes=[2, 2]`): ids repeat across groups, never within one;
- SGLang passes token-slot indices; with `page_size` they map to pages (a page is `page_size` slots).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from kvobs._runtime.ids import BadIds, int_list
from kvobs.errors import TransferRejected


class Blocks(NamedTuple):
    """The blocks of one transfer.

    ids: the ids as given (block ids, or token slots with a page size), as Python ints.
    distinct: sorted distinct block (page) ids: what the lock claims and the integrity check reads.
    count: blocks the transfer moves, for metrics: one per id (a block of each KV group counts), or one
        per distinct page for token slots.
    """

    ids: list[int]
    distinct: tuple[int, ...]
    count: int


def block_id_list(path: str, block_ids: Any, what: str = "block ids") -> list[int]:
    """Ids as a list of Python ints (see `kvobs._runtime.ids.int_list`: lists, tuples, ranges, 1-D integer
    arrays or tensors); TransferRejected naming the problem. None, sets, mappings, strings and iterators are
    refused: their order or length is not the call's."""
    try:
        return int_list(block_ids, what)
    except BadIds as exc:
        raise TransferRejected(path, str(exc)) from None


def validate_sync(path: str, is_sync: Any, *, sync_required: bool, completes_later: bool) -> None:
    """`is_sync=False` is refused on a sync-only path unless the guard keeps the transfer open until its
    completion arrives (then the lock covers the copy, which is the point of refusing otherwise)."""
    if is_sync is None or not sync_required:
        return
    if not isinstance(is_sync, bool):
        raise TransferRejected(path, f"is_sync must be a bool, got {type(is_sync).__name__} {is_sync!r}")
    if not is_sync and not completes_later:
        raise TransferRejected(
            path,
            "asynchronous transfers (is_sync=False) need the guard to stay open until the copy completes "
            "(complete_later=...); otherwise the cache lock would be released before the copy",
        )


def validate_keys(path: str, keys: Any, blocks: Blocks | None, *, paired: bool) -> None:
    """Keys are a sequence; paired one-to-one with block ids, except that the last block may lack one."""
    if keys is None:
        return
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise TransferRejected(path, f"keys must be a sequence of storage keys, got {type(keys).__name__}")
    if blocks is None or not paired:
        return
    n_ids = len(blocks.ids)
    if not n_ids - 1 <= len(keys) <= n_ids:
        raise TransferRejected(
            path,
            f"{len(keys)} storage keys but {n_ids} block ids; every full block needs a key "
            "(only the last, partial block may lack one)",
        )


def validate_nbytes(path: str, nbytes: Any) -> None:
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
        raise TransferRejected(path, f"nbytes must be a non-negative int, got {nbytes!r}")


def validate_key(path: str, key: Any, find_open: Callable[[str, Any], Any] | None) -> None:
    """The key a later completion finds the transfer by: hashable, and not taken by an open transfer
    (`find_open(path, key)`, asked only once the key is known to be hashable)."""
    try:
        hash(key)
    except TypeError:
        raise TransferRejected(path, f"key {key!r} is not hashable") from None
    if find_open is not None and find_open(path, key):
        raise TransferRejected(path, f"a {path} transfer is already open under key {key!r}")


def resolve_blocks(
    path: str,
    block_ids: Any,
    *,
    capacity: int | None,
    page_size: int | None = None,
    group_sizes: Any = None,
) -> Blocks:
    """Validate ids and derive the distinct blocks; raise TransferRejected naming the first problem."""
    try:  # block_id_list, inlined: the fast path's one call here
        ids = int_list(block_ids)
    except BadIds as exc:
        raise TransferRejected(path, str(exc)) from None
    ordered = sorted(ids) if page_size is None else None  # block ids: sorted anyway; token slots: only pages
    lowest = ordered[0] if ordered else min(ids, default=0)
    if lowest < 0:
        raise TransferRejected(path, f"block id {lowest} is negative")
    if ordered is None:
        return _token_slots(path, ids, page_size, capacity)
    if capacity is not None and ordered and ordered[-1] >= capacity:
        raise TransferRejected(path, f"block id {ordered[-1]} is out of range for a cache of {capacity} blocks")
    if group_sizes is None:
        _no_duplicates(path, ids, "block id")
        return Blocks(ids, tuple(ordered), len(ids))
    sizes = block_id_list(path, group_sizes, "group sizes")
    if any(s < 0 for s in sizes) or sum(sizes) != len(ids):
        raise TransferRejected(path, f"group sizes {sizes} must be non-negative and add up to the {len(ids)} block ids")
    start = 0
    for group, size in enumerate(sizes):
        _no_duplicates(path, ids[start : start + size], f"KV group {group}: block id")
        start += size
    return Blocks(ids, tuple(sorted(set(ids))), len(ids))


def resolve_requests(
    path: str, requests: Any, *, capacity: int | None, page_size: int | None = None
) -> tuple[dict[Any, int], Blocks]:
    """A batch: request id -> its block ids. No id twice within one request; requests may share blocks (a
    common prefix). Returns each request's block count and the union of the batch's blocks.

    Written for batches of many small requests: lists of plain ints are checked in C and all at once."""
    if not isinstance(requests, Mapping) or not requests:
        raise TransferRejected(path, f"requests must be a non-empty mapping of request id to block ids, got "
                                     f"{type(requests).__name__}")
    counts: dict[Any, int] = {}
    all_ids: list[int] = []
    plain = page_size is None
    for request_id, ids in requests.items():
        if plain and type(ids) is list and len(set(ids)) == len(ids):
            all_ids += ids
            counts[request_id] = len(ids)
            continue
        try:  # anything else, and every problem, gets the detailed check
            blocks = resolve_blocks(path, ids, capacity=capacity, page_size=page_size)
        except TransferRejected as exc:
            raise TransferRejected(path, f"request {request_id!r}: {exc.reason}") from None
        all_ids += blocks.ids
        counts[request_id] = blocks.count
    if plain:
        try:
            union = resolve_blocks(path, sorted(set(all_ids)), capacity=capacity).distinct
        except (TransferRejected, TypeError):  # some request holds a bad id: name it
            for request_id, ids in requests.items():
                try:
                    resolve_blocks(path, ids, capacity=capacity)
                except TransferRejected as exc:
                    raise TransferRejected(path, f"request {request_id!r}: {exc.reason}") from None
            raise
    else:
        union = tuple(sorted({slot // page_size for slot in all_ids}))
    return counts, Blocks(all_ids, union, sum(counts.values()))


def _token_slots(path: str, slots: list[int], page_size: int, capacity: int | None) -> Blocks:
    if capacity is not None and slots and max(slots) >= capacity * page_size:
        raise TransferRejected(
            path, f"token slot {max(slots)} is out of range for a cache of {capacity} pages of {page_size} slots"
        )
    _no_duplicates(path, slots, "token slot")
    pages = tuple(sorted({s // page_size for s in slots}))
    return Blocks(slots, pages, len(pages))


def _no_duplicates(path: str, ids: list[int], what: str) -> None:
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        dup = next(b for b in ids if b in seen or seen.add(b))  # type: ignore[func-returns-value]
        raise TransferRejected(path, f"{what} {dup} appears more than once")
