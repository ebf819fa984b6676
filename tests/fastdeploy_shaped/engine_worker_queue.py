"""`EngineWorkerQueue`'s cache-messager parts (upstream: inter_communicator/engine_worker_queue.py): cache
infos broadcast to every rank's messager, the ranks' barriers, and the reports back to the engine (a task
registered; a request's cache sent, merged over the ranks: any error status wins)."""

from __future__ import annotations

import threading
from typing import Any


class WorkerQueueServer:
    def __init__(self, num_client: int = 1, barrier_timeout: float | None = None) -> None:
        self.num_client = num_client
        self.lock = threading.Lock()
        self.cache_infos: list[list[dict]] = [[] for _ in range(num_client)]
        self.finished_add: list[list[Any]] = []
        self.finished_send: dict[str, list[str]] = {}
        self.finished_ready: list[list[Any]] = []
        for name in ("cache_info_barrier", "finish_add_cache_task_barrier", "begin_send_cache_barrier",
                     "finish_send_cache_barrier"):
            setattr(self, name, threading.Barrier(num_client, timeout=barrier_timeout))


class EngineWorkerQueue:
    def __init__(self, server: WorkerQueueServer, client_id: int = 0) -> None:
        self.server = server
        self.client_id = client_id
        for name in ("cache_info_barrier", "finish_add_cache_task_barrier", "begin_send_cache_barrier",
                     "finish_send_cache_barrier"):
            setattr(self, name, getattr(server, name))

    def put_cache_info(self, cache_info: list[dict]) -> None:
        with self.server.lock:
            for infos in self.server.cache_infos:
                infos.extend(dict(info) for info in cache_info)

    def get_cache_info(self) -> list[dict]:
        with self.server.lock:
            infos, self.server.cache_infos[self.client_id] = self.server.cache_infos[self.client_id], []
            return infos

    def put_finished_add_cache_task_req(self, req_ids: list[Any]) -> None:
        with self.server.lock:
            self.server.finished_add.append(list(req_ids))

    def put_finished_req(self, send_cache_result: list[list[Any]]) -> None:
        request_id, status = send_cache_result[0]
        with self.server.lock:
            statuses = self.server.finished_send.setdefault(request_id, [])
            statuses.append(status)
            if len(statuses) == self.server.num_client:
                merged = next((s for s in statuses if "error" in s), statuses[0])
                self.server.finished_ready.append([request_id, merged])
                del self.server.finished_send[request_id]

    def get_finished_req(self) -> list[list[Any]]:
        """The engine's side: `[[request_id, status]]` once every rank reported, else `[]`."""
        with self.server.lock:
            return [self.server.finished_ready.pop(0)] if self.server.finished_ready else []
