"""What a fast-lane call names: block ids, storage keys, `is_sync`, a byte count, a request id, validated before
the lock exactly as the general lifecycle validates them.

Why: most guards name their blocks and keys, and validating them is cheap next to the general lifecycle's own
bookkeeping. A guard naming anything else (a cache to check, a batch, KV groups, a completion key, a carried
trace context) runs the general lifecycle; and so does any call whose values do not resolve or validate,
which the general path then validates again and rejects exactly as it always does (counted, logged, raised).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvobs.validation import Blocks, resolve_blocks, validate_keys, validate_nbytes, validate_sync

LANE_SPECS = frozenset({"block_ids", "keys", "sync", "nbytes", "request_id"})


class LaneValues:
    """The start of a fast-lane call as the recorder reads it (`Recorder.Ended`'s start fields)."""

    trace_context = requests = None

    def __init__(self, blocks: Blocks | None, keys: Any, nbytes: int | None, request_id: Any) -> None:
        self.blocks, self.keys, self.nbytes, self.request_id = blocks, keys, nbytes, request_id


def lane_values(route: Any, resolvers: dict[str, Callable[[tuple, dict], Any]]
                ) -> Callable[[tuple, dict], LaneValues | None]:
    """Per call: the validated values, or None for the general path (a value that does not validate, or an
    empty list of blocks, which claims nothing)."""
    block_ids, keys, sync, nbytes, request_id = (resolvers.get(name) for name in (
        "block_ids", "keys", "sync", "nbytes", "request_id"))
    path, capacity, page_size, sync_required = route.path, route.capacity, route.page_size, route.sync_required

    def values(args: tuple, kwargs: dict) -> LaneValues | None:
        try:
            if sync is not None:
                validate_sync(path, sync(args, kwargs), sync_required=sync_required, completes_later=False)
            blocks = None
            if block_ids is not None:
                blocks = resolve_blocks(path, block_ids(args, kwargs), capacity=capacity, page_size=page_size)
                if not blocks.distinct:
                    return None
            given_keys = None if keys is None else keys(args, kwargs)
            validate_keys(path, given_keys, blocks, paired=page_size is None)
            size = None if nbytes is None else nbytes(args, kwargs)
            validate_nbytes(path, size)
            return LaneValues(blocks, given_keys, size, None if request_id is None else request_id(args, kwargs))
        except Exception:  # noqa: BLE001 - the general path resolves the call again and reports what is wrong
            return None  # (said outright: falling off the end would return None too)

    return values
