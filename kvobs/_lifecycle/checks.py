"""The NaN/Inf step of a transfer: which blocks are checked, and what a corrupt transfer returns instead.

Kept apart from the lifecycle (transfer.py), which decides *when* to check: the sources of a reading
transfer once the lock is held, the destinations of a writing transfer at completion, and (`check_copied`, for
engines that copy after the call) what a reading transfer's copy moved, at its completion.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

from kvobs._lifecycle.validation import Blocks, resolve_blocks
from kvobs.errors import CorruptKVError


class Checked(Protocol):
    """What the check reads and writes of a `kvobs._lifecycle.transfer.Transfer` (which calls it: no import back)."""

    path: str
    route: Any
    cache: Any
    cache_info: Any
    on_corrupt: Any
    bad_block_ids: tuple[int, ...]
    blocks: Blocks | None

UNSET: Any = object()  # "not given" for arguments; "clean, the transfer's own result stands" for checks


def replacement(t: Checked, blocks: Blocks | None, *, can_replace: bool) -> Any:
    """Check `blocks` of `t`'s cache under the lock. Returns the result that replaces a corrupt transfer's
    (`on_corrupt`'s, or `skip`'s), or UNSET when clean; raises CorruptKVError for `raise`, and for anything
    else when the caller's code cannot be replaced (a with-block, `obs.begin`)."""
    route = t.route
    if t.cache is None or blocks is None or not blocks.distinct or not route.sampler.should_check():
        return UNSET
    result = route.caches.check(t.cache_info, blocks.distinct)  # None: clean
    route.recorder.checked(t, result, route.policy.mode)
    if result is None or route.policy.mode == "count":
        return UNSET
    t.bad_block_ids = result.bad_block_ids
    if can_replace and t.on_corrupt is not None:
        return t.on_corrupt(t, t.bad_block_ids)
    if can_replace and route.policy.mode == "skip":
        return copy.copy(route.policy.skip_result)
    raise CorruptKVError(t.path, result)


def check_copied(t: Checked, cache: Any = None, block_ids: Any = None) -> Any:
    """At a reading transfer's completion, check what its copy actually moved: `cache` at `block_ids` (the
    destination, e.g. host pages after the copy's acknowledgement; ids read as the transfer's ids are), or by
    default the transfer's own sources again. Why: the sources were checked when the lock was taken, but an
    engine that copies later (a queue, a stream) carries a NaN written in between, unless the lock excludes
    every writer; only this second look sees it.

    Returns the CheckResult when it found NaN/Inf and the policy acts on it (`raise`, `skip`): the caller
    then takes the engine's failure path. None when clean, not checked, or under `count`. A finding is
    counted, logged, on the span, and in `t.bad_block_ids`."""
    route = t.route
    if route.policy is None:
        return None
    if cache is None:
        cache, layout, blocks = t.cache, t.cache_info, t.blocks
    else:
        blocks = resolve_blocks(t.path, block_ids, capacity=None, page_size=route.page_size)
        layout = route.caches.inspect(t.path, cache, blocks)
    if cache is None or layout is None or blocks is None or not blocks.distinct:
        return None
    result = route.caches.check(layout, blocks.distinct)  # None: clean
    route.recorder.checked(t, result, route.policy.mode)
    if result is None or route.policy.mode == "count":
        return None
    t.bad_block_ids = result.bad_block_ids
    return result
