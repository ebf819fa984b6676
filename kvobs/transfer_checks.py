"""The NaN/Inf step of a transfer: which blocks are checked, and what a corrupt transfer returns instead.

Kept apart from the lifecycle (transfer.py), which decides *when* to check: the sources of a reading
transfer once the lock is held, the destinations of a writing transfer at completion.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

from kvobs.errors import CorruptKVError
from kvobs.validation import Blocks


class Checked(Protocol):
    """What the check reads and writes of a `kvobs.transfer.Transfer` (which calls it: no import back)."""

    path: str
    route: Any
    cache: Any
    cache_info: Any
    on_corrupt: Any
    bad_block_ids: tuple[int, ...]

UNSET: Any = object()  # "not given" for arguments; "clean, the transfer's own result stands" for checks


def replacement(t: Checked, blocks: Blocks | None, *, can_replace: bool) -> Any:
    """Check `blocks` of `t`'s cache under the lock. Returns the result that replaces a corrupt transfer's
    (`on_corrupt`'s, or `skip`'s), or UNSET when clean; raises CorruptKVError for `raise`, and for anything
    else when the caller's code cannot be replaced (a with-block, `obs.begin`)."""
    route = t.route
    if t.cache is None or blocks is None or not blocks.distinct or not route.sampler.should_check():
        return UNSET
    result = route.caches.check(t.cache_info, blocks.distinct)
    route.recorder.checked(t, result, route.policy.mode)
    if result.clean or route.policy.mode == "count":
        return UNSET
    t.bad_block_ids = result.bad_block_ids
    if can_replace and t.on_corrupt is not None:
        return t.on_corrupt(t, t.bad_block_ids)
    if can_replace and route.policy.mode == "skip":
        return copy.copy(route.policy.skip_result)
    raise CorruptKVError(t.path, result)
