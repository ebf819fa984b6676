"""SGLang's acknowledgement lists, watched: the moment an ack is queued is when its copy started, the moment
SGLang takes it off the list is when SGLang knows the copy is done.

`HiCacheController.start_writing()` / `start_loading()` append one `HiCacheAck` per submitted copy (queued
operations merged, their `node_ids` concatenated) to `ack_write_queue` / `ack_load_queue`, plain lists.
SGLang's consumers (`writing_check` / `loading_check` of the radix cache, the decode offload manager) count
the acks whose `finish_event` is done, then `pop(0)` them; a blocking write-back drains the list with
`clear()` after waiting on every ack, and `reset()` clears it. Watching the list catches every consumer
without touching their loops: `AckList` is a list in every way SGLang uses it (append, pop, clear, remove,
del, len, iteration, truth), and tells an `AckWatcher` what entered and left.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvobs import Transfer
from kvobs.errors import CopyNotConfirmed, KVObsError


class AckWatcher:
    """Binds open transfers to the ack of the copy that moves them, and ends them when the ack leaves."""

    def __init__(self, path: str, on_error: Callable[[str, BaseException], None],
                 verify: Callable[[Transfer], BaseException | None] | None = None) -> None:
        self.path = path
        self._on_error = on_error
        self._verify = verify  # at the ack, what the copy moved: an error fails the transfer instead
        self._lock = threading.Lock()
        self._pending: list[Transfer] = []  # begun, their operation queued, no ack yet
        self._bound: dict[int, list[Transfer]] = {}  # id(ack) -> transfers it completes

    def queued(self, t: Transfer) -> None:
        """`t`'s operation is in SGLang's queue; the next ack naming its node carries it."""
        with self._lock:
            self._pending.append(t)

    def unqueued(self, t: Transfer) -> None:
        """SGLang refused the operation after `t` began (nothing queued): forget it."""
        with self._lock:
            if t in self._pending:
                self._pending.remove(t)

    def submitted(self, ack: Any) -> None:
        """An ack was queued: the pending transfers of its nodes (oldest first) are now being copied."""
        try:
            with self._lock:
                self._pending = [t for t in self._pending if t.outcome is None]  # drop those already ended
                taken = [t for t in map(self._take, ack.node_ids) if t is not None]
                if taken:
                    self._bound[id(ack)] = taken
            for t in taken:
                t.submitted()
        except Exception as exc:  # noqa: BLE001 - runs inside SGLang's start_writing/start_loading
            self._on_error("ack_submitted", exc)

    def _take(self, node_id: Any) -> Transfer | None:
        for i, t in enumerate(self._pending):
            if t.request_id == node_id:
                return self._pending.pop(i)
        return None

    def left(self, ack: Any, *, consumed: bool) -> None:
        """An ack left the list. Consumed (popped by a check): SGLang knows the copy is done; wait for its
        event as SGLang does next, then complete. Dropped (cleared): complete if the copy finished, else fail."""
        try:
            with self._lock:
                transfers = self._bound.pop(id(ack), None)
            if not transfers:
                return
            finished = ack.finish_event
            if consumed:
                finished.synchronize()
            elif not finished.query():
                error = CopyNotConfirmed(self.path, "the acknowledgement was dropped before the copy finished")
                for t in transfers:
                    t.fail(error)
                return
            for t in transfers:
                self._complete(t)
        except Exception as exc:  # noqa: BLE001 - runs inside SGLang's checks: never break them
            self._on_error("ack_consumed", exc)

    def _complete(self, t: Transfer) -> None:
        error = None
        if self._verify is not None:
            try:
                error = self._verify(t)
            except Exception as exc:  # noqa: BLE001 - a check that cannot run leaves the transfer to complete
                self._on_error("ack_verify", exc)
        if error is not None:
            t.fail(error)
            return
        try:
            t.complete()
        except KVObsError:
            pass  # a corrupt destination: recorded on the transfer (outcome error, CorruptKVError), counted, logged

    def open_transfers(self) -> list[Transfer]:
        with self._lock:
            bound = [t for ts in self._bound.values() for t in ts]
            return [t for t in self._pending + bound if t.outcome is None]


class AckList(list):
    """A list that reports acks entering and leaving to its watcher (see the module docstring)."""

    __slots__ = ("watcher",)

    def __init__(self, items: Any, watcher: AckWatcher) -> None:
        super().__init__(items)
        self.watcher = watcher

    def append(self, ack: Any) -> None:
        super().append(ack)
        self.watcher.submitted(ack)

    def pop(self, index: Any = -1) -> Any:
        ack = super().pop(index)
        self.watcher.left(ack, consumed=True)
        return ack

    def remove(self, ack: Any) -> None:
        super().remove(ack)
        self.watcher.left(ack, consumed=True)

    def __delitem__(self, index: Any) -> None:
        gone = self[index] if isinstance(index, slice) else [self[index]]
        super().__delitem__(index)
        for ack in gone:
            self.watcher.left(ack, consumed=True)

    def clear(self) -> None:
        gone = list(self)
        super().clear()
        for ack in gone:
            self.watcher.left(ack, consumed=False)
