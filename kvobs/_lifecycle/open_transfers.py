"""The transfers holding the cache lock now: counted per path, found by key, abandoned past their deadline.

A transfer enters when it acquires the lock and leaves in the same C-level step that releases it (its
removal is one of its undo steps, see `kvobs._runtime.atomic`), so the counts never disagree with the lock. A
transfer is findable by key only once every undo step is recorded: nothing is pushed after another thread
may end it. One daemon thread per process abandons open transfers past their deadline (`due`); it holds
observers' tables weakly and is restarted in a forked child, where the parent's open transfers are
forgotten. Nothing may end that thread: without it a lost completion holds the lock for ever. A round that
raises, whatever it raised, is counted as a restart under every watched observer's
`kvobs_telemetry_errors_total{stage="deadline_thread"}` and logged once per interval, and the rounds go on.
Transfers held by the lifecycle's fast path (`kvobs._lifecycle.fast_lane`) are not entered here: they are counted, aged
and abandoned through the lanes a table watches, where a slot's transfer is open exactly while its release is
pending.
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
import threading
import time
import weakref
from collections.abc import Callable
from itertools import compress
from time import perf_counter
from typing import Any, Protocol

from kvobs._runtime.atomic import Held, push_unless_raises
from kvobs.telemetry._failures import LOG_INTERVAL_S
from kvobs.telemetry._logs import default_logger
from kvobs.telemetry._ratelimit import RateLimitedLog

_MIN_SLEEP_S = 0.005
_MAX_SLEEP_S = 0.5
EVENT_RESTARTED = "kvobs.deadline_thread.restarted"


class Abandonable(Protocol):
    path: str
    key: Any  # None, or what a completion finds it by
    t_begin: float
    due: float  # perf_counter() time past which the transfer is abandoned

    def abandon(self) -> None: ...


class OpenTransfers:
    """One observer's open transfers. Every mutation is a single dict operation (atomic under the GIL)."""

    def __init__(self, paths: tuple[str, ...], deadline_s: float,
                 count_restart: Callable[[], None] | None = None) -> None:
        """count_restart: counts a restart of the deadline thread in the observer's metrics."""
        self._seq = itertools.count()
        self.count_restart = count_restart
        self.by_path: dict[str, dict[int, Abandonable]] = {p: {} for p in paths}
        self.by_key: dict[tuple[str, Any], Abandonable] = {}
        self.lanes: list[Any] = []  # fast lanes (`kvobs._lifecycle.fast_lane`) this observer's calls may take
        _REAPER.watch(self, deadline_s)

    def watch_lane(self, lane: Any) -> None:
        """Count, age and abandon this observer's calls on `lane` too."""
        if lane not in self.lanes:
            self.lanes.append(lane)

    def enter(self, held: Held, t: Abandonable) -> bool:
        """Count `t` as open until its undo steps run, and with a key make it findable under (path, key). False
        when another open transfer has that key: `t` is then counted, not findable, until its undo steps run.
        Each insertion records its undo in the same C call (`kvobs._runtime.atomic`)."""
        seq = next(self._seq)
        table = self.by_path[t.path]
        push_unless_raises(held, functools.partial(table.pop, seq, None), table.__setitem__, seq, t)
        if t.key is None:
            return True
        slot = (t.path, t.key)
        undo = functools.partial(self.by_key.pop, slot, None)
        before = len(held)
        inserted = map(functools.partial(operator.is_, t), map(self.by_key.setdefault, (slot,), (t,)))
        held.extendleft(compress((undo,), inserted))
        return len(held) != before

    def find(self, path: str, key: Any) -> Abandonable | None:
        return self.by_key.get((path, key))

    def count(self, path: str) -> int:
        return len(self.by_path[path]) + sum(len(lane.open_calls(self, path)) for lane in self.lanes)

    def oldest_age(self, path: str) -> float:
        """Seconds since the oldest open transfer on `path` began; 0.0 when none is open."""
        try:
            oldest = next(iter(self.by_path[path].values()), None)
        except RuntimeError:  # the table changed while being read (another thread): report none this time
            oldest = None
        begins = [t.t_begin for lane in self.lanes for t in lane.open_calls(self, path)]
        if oldest is not None:
            begins.append(oldest.t_begin)
        return max(0.0, perf_counter() - min(begins)) if begins else 0.0

    def expired(self, now: float) -> list[Abandonable]:
        """Open transfers past their deadline."""
        due_now: list[Abandonable] = []
        for table in list(self.by_path.values()):
            try:
                due_now.extend(t for t in table.values() if t.due <= now)
            except RuntimeError:  # changed by another thread while read: the next round looks again
                pass
        for lane in self.lanes:
            due_now.extend(lane.expired(now))
        return due_now

    def forget(self) -> None:
        """In a forked child: the parent's open transfers are not this process's."""
        self.by_key.clear()
        for table in self.by_path.values():
            table.clear()


class _Reaper:
    """One daemon thread per process abandoning open transfers past their deadline.

    It polls (at a quarter of the shortest deadline, within [5 ms, 0.5 s]) rather than being woken, so
    nothing on the transfers' hot path takes a lock: a Python-level lock taken on the main thread could
    itself be leaked by an asynchronous exception. The thread starts with the first observer. Its loop is
    supervised: an exception of any kind (BaseException too: one injected into the thread) ends the round,
    counts a restart (`restarts`, and per observer) and starts the next round.
    """

    def __init__(self) -> None:
        self._tables: weakref.WeakSet[OpenTransfers] = weakref.WeakSet()
        self._tables_lock = threading.Lock()  # adding a table while the thread copies the set would break the copy
        self._interval = _MAX_SLEEP_S
        self._thread: threading.Thread | None = None
        self.restarts = 0  # rounds ended by an exception
        self._log = RateLimitedLog(default_logger(), LOG_INTERVAL_S)

    def watch(self, table: OpenTransfers, deadline_s: float) -> None:
        with self._tables_lock:
            self._tables.add(table)
            self._interval = min(self._interval, max(deadline_s / 4, _MIN_SLEEP_S))
            if self._thread is None or not self._thread.is_alive():
                self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvobs-transfer-deadlines", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._rounds()
            except BaseException as exc:  # noqa: BLE001 - the thread must outlive anything raised in it
                try:
                    self._restarted(exc)
                except BaseException:  # noqa: BLE001, S110 - not even reporting the restart may end the thread
                    pass

    def _rounds(self) -> None:
        while True:
            time.sleep(self._interval)
            now = perf_counter()
            for table in self._watched():
                for t in table.expired(now):
                    _abandon_quietly(t.abandon)

    def _watched(self) -> list[OpenTransfers]:
        with self._tables_lock:
            return list(self._tables)

    def _restarted(self, exc: BaseException) -> None:
        """Count the restart under every watched observer; log it once per interval (with how many were not)."""
        self.restarts += 1
        for table in self._watched():
            if table.count_restart is not None:
                table.count_restart()
        self._log.log(type(exc), "warning", EVENT_RESTARTED, error_type=type(exc).__qualname__,
                      restarts=self.restarts, exc_info=exc)

    def after_fork_in_child(self) -> None:
        """The thread did not survive the fork, and the parent's open transfers are not the child's."""
        self._thread = None
        self._tables_lock = threading.Lock()  # the parent's thread may have held it at the fork
        tables = list(self._tables)
        for table in tables:
            table.forget()
        if tables:
            self._start()


def _abandon_quietly(abandon: Callable[[], None]) -> None:
    """The reaper must outlive any one transfer's failure to record its abandonment."""
    try:
        abandon()
    except Exception:  # noqa: BLE001 - abandon() counts its own telemetry failures; nothing else may stop the thread
        pass


_REAPER = _Reaper()
os.register_at_fork(after_in_child=_REAPER.after_fork_in_child)
