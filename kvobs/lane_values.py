"""What a fast-lane call names: its block ids, byte count and request id, validated before the lock.

Why: most guards name their blocks, and validating them is cheap next to the general lifecycle's own
bookkeeping. A guard naming anything else (keys, a cache to check, a batch, a completion key...) runs the
general lifecycle; and so does any call whose values do not resolve or validate, which the general path then
validates again and rejects exactly as it always does (counted, logged, raised).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvobs.validation import Blocks, resolve_blocks, validate_nbytes

LANE_SPECS = frozenset({"block_ids", "nbytes", "request_id"})


class LaneValues:
    """The start of a fast-lane call as the recorder reads it (`Recorder.Ended`'s start fields)."""

    trace_context = keys = requests = None

    def __init__(self, blocks: Blocks | None, nbytes: int | None, request_id: Any) -> None:
        self.blocks, self.nbytes, self.request_id = blocks, nbytes, request_id


def lane_values(route: Any, resolvers: dict[str, Callable[[tuple, dict], Any]]
                ) -> Callable[[tuple, dict], LaneValues | None]:
    """Per call: the validated values, or None for the general path (a value that does not validate, or an
    empty list of blocks, which claims nothing)."""
    block_ids, nbytes, request_id = (resolvers.get(name) for name in ("block_ids", "nbytes", "request_id"))
    path, capacity, page_size = route.path, route.capacity, route.page_size

    def values(args: tuple, kwargs: dict) -> LaneValues | None:
        try:
            blocks = None
            if block_ids is not None:
                blocks = resolve_blocks(path, block_ids(args, kwargs), capacity=capacity, page_size=page_size)
                if not blocks.distinct:
                    return None
            size = None if nbytes is None else nbytes(args, kwargs)
            validate_nbytes(path, size)
            return LaneValues(blocks, size, None if request_id is None else request_id(args, kwargs))
        except Exception:  # noqa: BLE001 - the general path resolves the call again and reports what is wrong
            return None  # (said outright: falling off the end would return None too)

    return values
