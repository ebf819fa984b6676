"""`EngineCacheQueue` (upstream: inter_communicator/engine_cache_queue.py): the engine puts storage tasks
that every tensor-parallel rank's cache transfer process reads; each rank answers with done signals.
Upstream it is a multiprocessing manager; here one shared state object and a client per rank."""

from __future__ import annotations

import collections
import queue
import threading
from typing import Any


class CacheQueueServer:
    """What the manager process holds: per-client task lists, the done signals, the ranks' barriers."""

    def __init__(self, num_client: int = 1, barrier_timeout: float | None = None) -> None:
        self.num_client = num_client
        self.tasks = [collections.deque() for _ in range(num_client)]
        self.done_signals: queue.Queue[Any] = queue.Queue()
        self.lock = threading.Lock()
        for name in ("barrier1", "barrier2", "barrier3", "swap_storage_to_gpu_barrier", "swap_to_storage_barrier"):
            setattr(self, name, threading.Barrier(num_client, timeout=barrier_timeout))


class EngineCacheQueue:
    """One client: the engine's (`client_id=None`) or a rank's cache transfer process's."""

    def __init__(self, server: CacheQueueServer, client_id: int | None = None) -> None:
        self.server = server
        self.client_id = client_id
        for name in ("barrier1", "barrier2", "barrier3", "swap_storage_to_gpu_barrier", "swap_to_storage_barrier"):
            setattr(self, name, getattr(server, name))

    def put_transfer_task(self, item: Any) -> None:
        with self.server.lock:
            for tasks in self.server.tasks:
                tasks.append(item)

    def get_transfer_task(self) -> tuple[Any, bool]:
        """(task, read_finish): this rank's next task, and whether no task is left for it."""
        with self.server.lock:
            tasks = self.server.tasks[self.client_id]
            data = tasks.popleft() if tasks else None
            return data, not tasks

    def empty(self) -> bool:
        with self.server.lock:
            return not self.server.tasks[self.client_id or 0]

    def put_transfer_done_signal(self, item: Any) -> None:
        self.server.done_signals.put(item)

    def get_transfer_done_signal(self) -> Any:
        """The next done signal, or None when there is none (the engine's receiver polls)."""
        try:
            return self.server.done_signals.get(timeout=0.005)
        except queue.Empty:
            return None
