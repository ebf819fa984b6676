"""Multiprocess mode: scrape-time gauges copied into prometheus_client's per-process files by a thread.

The scraping process cannot call into the workers, so each worker writes its scrape-time values (lock held
seconds, open transfers, pending signals) into its multiprocess gauges every `interval_s`. A thread does not
survive `fork`, so forked workers start their own. Cells are held weakly: an observer the engine drops is
collected with its readers, and its series are set to 0 on the next round.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import deque
from typing import Any

from kvobs._runtime.forks import in_forked_child
from kvobs.telemetry._failures import STAGE_METRICS, Failed
from kvobs.telemetry._metrics.accumulators import GaugeCell


class Refresher:
    """One per process (`Refresher.shared()`): a daemon thread writing each watched cell into its child."""

    interval_s = 0.5
    _instance: Refresher | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[GaugeCell], Any, Failed]] = {}
        self._dead: deque[int] = deque()  # keys of collected cells: their children are set to 0
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @classmethod
    def shared(cls) -> Refresher:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
                in_forked_child(_restart_in_child)
            return cls._instance

    def watch(self, cell: GaugeCell, child: Any, failed: Failed) -> None:
        """Write `cell.get()` into the prometheus_client gauge child `child` now and every round; a write
        that fails is reported as `failed("metrics", exc)`."""
        key = next(self._keys)
        dead = self._dead
        ref = weakref.ref(cell, lambda _ref, key=key: dead.append(key))
        with self._lock:
            self._entries[key] = (ref, child, failed)
            self._ensure_thread()
        _write(child, cell.get(), failed)

    def refresh(self) -> None:
        """One round: zero the series of collected cells, then write every live cell's value."""
        with self._lock:
            while self._dead:
                entry = self._entries.pop(self._dead.popleft(), None)
                if entry is not None:
                    _write(entry[1], 0.0, entry[2])
            entries = list(self._entries.values())
        for ref, child, failed in entries:
            cell = ref()
            if cell is not None:
                _write(child, cell.get(), failed)

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kvobs-gauge-refresher", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            self.refresh()

    def _after_fork_in_child(self) -> None:
        """The parent's thread did not come along, and its lock may have been held at the fork."""
        self._lock = threading.Lock()
        self._thread = None
        if self._entries:
            self._ensure_thread()


def _restart_in_child() -> None:
    instance = Refresher._instance
    if instance is not None:
        instance._after_fork_in_child()


def _write(child: Any, value: float, failed: Failed) -> None:
    try:
        child.set(value)
    except Exception as exc:  # noqa: BLE001 - keep refreshing the others
        failed(STAGE_METRICS, exc)
