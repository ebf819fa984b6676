"""A block claim turned into byte-range lock requests, checked before any lock is touched.

Block b is byte b of the lock file; a run of consecutive ids becomes one range, so one kernel call. With a
`coalesce_gap`, runs separated by at most that many unclaimed blocks are bridged into one range. A claim
never takes more than `max_ranges` ranges: beyond that, the smallest gaps are bridged until it fits, since
each kernel call scans every lock already on the file and a claim of n ranges would cost O(n^2).
"""

from __future__ import annotations

import fcntl
import functools
import heapq
import operator
import os
from itertools import islice, repeat
from typing import NamedTuple

from kvobs.locks import _ofd as ofd
from kvobs.locks._cache_lock import Claim

__all__ = ["BlockPlanner", "Plan"]

# (start, length, 0) -> struct flock of a claim's range, by claim.exclusive
_PACKERS = {
    exclusive: functools.partial(ofd.FLOCK.pack, kind, os.SEEK_SET)
    for exclusive, kind in ((True, fcntl.F_WRLCK), (False, fcntl.F_RDLCK))
}


class Plan(NamedTuple):
    """A claim turned into lock requests: one ``struct flock`` per run of consecutive blocks."""

    requests: list[bytes]
    starts: list[int]
    lengths: list[int]
    blocks: int


class BlockPlanner:
    """Plans the claims of one block lock (`name` is only for error messages)."""

    def __init__(self, name: str, num_blocks: int, coalesce_gap: int, max_ranges: int) -> None:
        self.name = name
        self.num_blocks = num_blocks
        self.coalesce_gap = coalesce_gap
        self.max_ranges = max_ranges
        self._whole = {
            exclusive: Plan([ofd.pack(kind, 0, num_blocks)], [0], [num_blocks], num_blocks)
            for exclusive, kind in ((True, fcntl.F_WRLCK), (False, fcntl.F_RDLCK))
        }

    def plan(self, claim: Claim) -> Plan:
        """Check the ids (sorted, distinct, in range) and coalesce them into runs; no blocks: the whole cache."""
        blocks = claim.blocks
        if not blocks:
            return self._whole[bool(claim.exclusive)]
        first = blocks[0]
        last = blocks[-1]
        if type(first) is not int or type(last) is not int or first < 0 or last >= self.num_blocks:
            raise ValueError(
                f"block ids of {self.name!r} must be ints from 0 to {self.num_blocks - 1}; got {first!r}..{last!r}"
            )
        count = len(blocks)
        if last - first == count - 1 and all(map(operator.lt, blocks, islice(blocks, 1, None))):
            starts = [first]  # one run: checked in C, no per-id bytecode
            lengths = [count]
        else:
            starts, lengths = self._runs(blocks)
            if len(starts) > self.max_ranges:
                starts, lengths = _bridged(starts, lengths, self.max_ranges)
        requests = list(map(_PACKERS[bool(claim.exclusive)], starts, lengths, repeat(0)))
        return Plan(requests, starts, lengths, count)

    def locked_blocks(self, claim: Claim) -> set[int]:
        """The blocks a claim locks: its own, and the gap blocks bridged between them (`coalesce_gap`,
        `max_ranges`)."""
        plan = self.plan(claim)
        if sum(plan.lengths) == plan.blocks:
            return set(claim.blocks)
        return {block for start, length in zip(plan.starts, plan.lengths) for block in range(start, start + length)}

    def _runs(self, blocks: tuple[int, ...]) -> tuple[list[int], list[int]]:
        """(starts, lengths) of the runs of consecutive ids (gaps up to `coalesce_gap` bridged)."""
        first = blocks[0]
        starts = [first]
        ends = []
        expected = first
        gap = self.coalesce_gap
        for block in blocks:
            if block != expected:
                if block < expected:
                    raise ValueError(f"block ids must be sorted and distinct; {block!r} follows {expected - 1!r}")
                if block - expected > gap:
                    ends.append(expected)
                    starts.append(block)
            expected = block + 1
        ends.append(expected)
        return starts, list(map(operator.sub, ends, starts))


def _bridged(starts: list[int], lengths: list[int], max_ranges: int) -> tuple[list[int], list[int]]:
    """The runs merged into `max_ranges` ranges by bridging every gap but the `max_ranges - 1` widest: the
    fewest unclaimed blocks locked for that many ranges, in O(n log max_ranges)."""
    ends = list(map(operator.add, starts, lengths))
    gaps = list(map(operator.sub, islice(starts, 1, None), ends))
    kept = sorted(heapq.nlargest(max_ranges - 1, range(len(gaps)), key=gaps.__getitem__))
    new_starts = [starts[0], *(starts[gap + 1] for gap in kept)]
    new_ends = [*(ends[gap] for gap in kept), ends[-1]]
    return new_starts, list(map(operator.sub, new_ends, new_starts))
