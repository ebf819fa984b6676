"""Whether a prefix hit's blocks are still claimed: how a scheduler under a block lock avoids waiting for them.

The engine believes a prefetch that has started is as good as done (the belief behind the NaN incident). A
lock held from the prefetch's begin to its completion turns that belief into a wait instead of a race: the
forward step's claim covers the prefix blocks it reads, so it waits for the copy. Under a global lock the
step waits for every transfer anyway. Under a block lock the scheduler can do better: ask the lock, without
waiting, whether the prefix blocks are free, and leave that one request for a later step while the rest of
the batch goes ahead. The lock stays the guarantee: the step still claims every block it touches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import kvobs
from kvobs import semconv as sc


@dataclass(frozen=True)
class PrefixProbe:
    """Zero-timeout claims on one lock, released at once."""

    lock: kvobs.BlockLock

    def free(self, block_ids: Sequence[int]) -> bool:
        """True when nobody claims any of `block_ids` now (a forward step's claim of them would not wait)."""
        try:
            with self.lock.claim(sorted(block_ids), exclusive=True, timeout=0, holder=sc.HOLDER_FORWARD):
                return True
        except kvobs.LockTimeout:
            return False
