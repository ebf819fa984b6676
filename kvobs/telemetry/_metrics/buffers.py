"""Per-thread record buffers: the recording thread appends its values, the accumulators are updated in batches.

Why: a transfer's telemetry is seven values into three histograms and three counters. Extending the calling
thread's own flat list with one record takes no lock and no per-value work. The binning happens once per
batch (each field is one strided slice of the flat list; each histogram's values are sorted once and cut at
the bucket bounds), when a buffer holds `DRAIN_AT` records or when the registry is scraped, so scrapes
always see every record.

Correctness rests on atomic list operations: the owning thread only ever extends its list by whole records
(one `extend` per record), and a drainer takes the first `k` values with one slice and removes exactly those
with one `del`, so a record added in between stays for the next drain. Drainers serialise on the families'
lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

DRAIN_AT = 1024  # records per thread before the recording thread folds them in itself

Flat = list[Any]


class ThreadBuffers:
    """One flat list per recording thread, of records `width` values wide. `apply(values)` folds a batch (a
    flat list holding whole records) into the accumulators; it runs under `lock` and must not raise."""

    def __init__(self, width: int, apply: Callable[[Flat], None], lock: threading.Lock) -> None:
        self.local = threading.local()
        self.full = DRAIN_AT * width  # buffer length at which the recording thread folds it in
        self.lock = lock
        self._apply = apply
        self._buffers: list[tuple[threading.Thread, Flat]] = []

    def new_buffer(self) -> Flat:
        """This thread's buffer, created on its first record."""
        buffer: Flat = []
        self.local.values = buffer
        with self.lock:
            self._buffers.append((threading.current_thread(), buffer))
        return buffer

    def add(self, records: Iterable[Any]) -> None:
        """Append whole records to the calling thread's buffer (one `extend`), folding it in once it is full."""
        try:
            buffer = self.local.values
        except AttributeError:
            buffer = self.new_buffer()
        buffer.extend(records)
        if len(buffer) >= self.full:
            self.drain(buffer)

    def drain(self, buffer: Flat) -> None:
        """Fold `buffer` in now (the owning thread, when it is full)."""
        with self.lock:
            self._take(buffer)

    def drain_all_locked(self) -> None:
        """Fold in every thread's records (a scrape); the caller holds `lock`. Buffers of threads that have
        ended are dropped once empty."""
        kept = []
        for thread, buffer in self._buffers:
            alive = thread.is_alive()  # asked first: an ended thread adds nothing after it
            self._take(buffer)
            if alive:
                kept.append((thread, buffer))
        self._buffers = kept

    def _take(self, buffer: Flat) -> None:
        count = len(buffer)
        if count:
            values = buffer[:count]
            del buffer[:count]
            self._apply(values)
