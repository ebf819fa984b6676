"""The storage cache (a Mooncake store, a file store...): block-sized entries by key, least recently used out.

Entries are immutable tensors: `put` stores the tensor it is given (the write-back hands it a copy), `get`
returns the stored tensor, `poison` replaces one with NaN (the `--fault nan` injection). What reached the
store holding NaN/Inf is counted by the write-back into `RunStats`, as ground truth independent of kvobs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class StorageCache:
    """A thread-safe LRU map from storage key to one block's KV values."""

    def __init__(self, capacity: int = 128) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def put(self, key: str, block: torch.Tensor) -> None:
        with self._lock:
            self._entries[key] = block
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            block = self._entries.get(key)
            if block is not None:
                self._entries.move_to_end(key)
            return block

    def longest_prefix(self, keys: list[str]) -> list[torch.Tensor]:
        """The stored blocks of the longest run of `keys` present from the start (a prefix hit), in order."""
        found = []
        with self._lock:
            for key in keys:
                block = self._entries.get(key)
                if block is None:
                    break
                self._entries.move_to_end(key)
                found.append(block)
        return found

    def missing(self, keys: list[str]) -> list[int]:
        """Indexes of the keys not stored: what a write-back still has to store."""
        with self._lock:
            return [i for i, k in enumerate(keys) if k not in self._entries]

    def evict(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self._entries.pop(key, None)

    def poison(self, key: str) -> bool:
        """Replace a stored entry with NaN (fault injection); False when the key is not stored."""
        with self._lock:
            block = self._entries.get(key)
            if block is None:
                return False
            self._entries[key] = torch.full_like(block, float("nan"))
            return True
