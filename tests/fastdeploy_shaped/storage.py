"""A storage backend (upstream: FileStore / MooncakeStore): keys to one block of one rank, all layers."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np


class DictStore:
    """`query` counts the leading keys present (key and value); `vanish` makes a key disappear between the
    query and the read (another node evicted it), so fewer blocks load than were matched."""

    def __init__(self) -> None:
        self.blocks: dict[str, np.ndarray] = {}
        self.vanish: set[str] = set()
        self.hang = threading.Event()  # set: reads and writes block until `release` is set
        self.release = threading.Event()
        self.lock = threading.Lock()

    def query(self, k_keys: list[str], v_keys: list[str], k_scale_keys: Any, v_scale_keys: Any,
              timeout: float) -> int:
        with self.lock:
            count = 0
            for k, v in zip(k_keys, v_keys):
                if k not in self.blocks or v not in self.blocks:
                    break
                count += 1
            return count

    def batch_get(self, keys: list[str]) -> list[np.ndarray | None]:
        self._maybe_hang()
        with self.lock:
            for key in self.vanish & set(keys):
                self.blocks.pop(key, None)
            return [self.blocks.get(key) for key in keys]

    def batch_set(self, keys: list[str], values: list[np.ndarray]) -> None:
        self._maybe_hang()
        with self.lock:
            self.blocks.update((k, np.array(v, copy=True)) for k, v in zip(keys, values))

    def _maybe_hang(self) -> None:
        if self.hang.is_set():
            self.release.wait()
