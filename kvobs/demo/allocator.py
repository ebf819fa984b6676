"""The block allocator: hands out free block ids and takes freed ones back, most recently freed first.

LIFO reuse is what real allocators tend to do (a hot free list) and it is what makes the write-back race
likely: a block freed a moment ago is the next one handed to a new request.
"""

from __future__ import annotations

import threading


class OutOfBlocks(RuntimeError):
    """Not enough free blocks for an allocation; the scheduler waits and tries again."""


class BlockAllocator:
    """Thread-safe free list over `num_blocks` ids. It guards its own list only, never the block contents."""

    def __init__(self, num_blocks: int) -> None:
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first
        self._lock = threading.Lock()

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
            return [self._free.pop() for _ in range(n)]

    def free(self, ids: list[int]) -> None:
        """Return blocks; the last freed is the first handed out again."""
        with self._lock:
            self._free.extend(reversed(ids))

    @property
    def free_count(self) -> int:
        return len(self._free)
