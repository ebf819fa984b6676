"""Per-thread record buffers: the recording thread appends a tuple, the accumulators are updated in batches.

Why: a transfer's telemetry is seven values into three histograms and three counters. Appending one tuple
to the calling thread's own list takes no lock and costs about as much as a bare `with threading.Lock()`;
the binning happens once per batch, sorted and cut at the bucket bounds, when a buffer holds `DRAIN_AT`
records or when the registry is scraped (so scrapes always see every record).

Correctness rests on two atomic list operations: the owning thread only ever appends, and a drainer takes
the first `k` records with one slice and removes exactly those with one `del`, so a record appended in
between stays for the next drain. Drainers serialise on the families' lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

DRAIN_AT = 1024

Record = tuple[Any, ...]


class ThreadBuffers:
    """One list per recording thread. `apply(records)` folds a batch into the accumulators; it runs under
    `lock` and must not raise (failures are the caller's to count)."""

    def __init__(self, apply: Callable[[list[Record]], None], lock: threading.Lock) -> None:
        self.local = threading.local()
        self.lock = lock
        self._apply = apply
        self._buffers: list[tuple[threading.Thread, list[Record]]] = []

    def new_buffer(self) -> list[Record]:
        """This thread's buffer, created on its first record."""
        buffer: list[Record] = []
        self.local.records = buffer
        with self.lock:
            self._buffers.append((threading.current_thread(), buffer))
        return buffer

    def drain(self, buffer: list[Record]) -> None:
        """Fold `buffer` in now (the owning thread, when it is full)."""
        with self.lock:
            self._take(buffer)

    def drain_all_locked(self) -> None:
        """Fold in every thread's records (a scrape); the caller holds `lock`. Buffers of threads that have
        ended are dropped once empty."""
        kept = []
        for thread, buffer in self._buffers:
            alive = thread.is_alive()  # asked first: an ended thread appends nothing after it
            self._take(buffer)
            if alive:
                kept.append((thread, buffer))
        self._buffers = kept

    def _take(self, buffer: list[Record]) -> None:
        count = len(buffer)
        if count:
            records = buffer[:count]
            del buffer[:count]
            self._apply(records)
