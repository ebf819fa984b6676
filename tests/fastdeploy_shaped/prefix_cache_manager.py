"""`PrefixCacheManager`'s storage paths (upstream: cache_manager/prefix_cache_manager.py).

The engine issues a storage task to the cache transfer processes and, when `is_sync`, waits on an Event
(no timeout) that its receiver thread sets from the done signals: a read once every tensor-parallel rank
answered (keeping the shortest list of loaded blocks), a write-back on its first signal.
"""

from __future__ import annotations

import logging
import threading
import time
from threading import Event
from typing import Any

from fastdeploy_shaped.cache_data import CacheStatus, ReadStorageTask, WriteStorageTask

logger = logging.getLogger("fastdeploy_shaped.prefix_cache_manager")


class PrefixCacheManager:
    def __init__(self, cache_task_queue: Any, tensor_parallel_size: int = 1,
                 kvcache_storage_backend: str | None = "file") -> None:
        self.cache_task_queue = cache_task_queue
        self.tensor_parallel_size = tensor_parallel_size
        self.kvcache_storage_backend = kvcache_storage_backend
        self.task_prefetch_event: dict[str, Event] = {}
        self.task_write_back_event: dict[str, Event] = {}
        self.storage_prefetch_block_ids: dict[str, Any] = {}
        self._stop = threading.Event()

    def issue_write_back_storage_task(self, task: WriteStorageTask, is_sync=True):
        if self.kvcache_storage_backend is None:
            return
        if len(task.keys) != len(task.gpu_block_ids):
            err_msg = f"write_back_storage error: hash_keys({len(task.keys)}) != gpu_block_ids({len(task.gpu_block_ids)})"
            logger.error(err_msg)
            raise ValueError(err_msg)
        self.task_write_back_event[task.task_id] = Event()
        self.cache_task_queue.put_transfer_task((CacheStatus.GPU2STORAGE, task))
        if is_sync:
            self.wait_write_storage_task(task.task_id)

    def wait_write_storage_task(self, req_id):
        if req_id in self.task_write_back_event:
            self.task_write_back_event[req_id].wait()
            del self.task_write_back_event[req_id]

    def issue_prefetch_storage_task(self, task: ReadStorageTask, is_sync=True):
        if self.kvcache_storage_backend is None:
            return []
        storage_block_ids = []
        self.task_prefetch_event[task.task_id] = Event()
        self.cache_task_queue.put_transfer_task((CacheStatus.STORAGE2GPU, task))
        if is_sync:
            storage_block_ids = self.wait_prefetch_storage_task(task.task_id)
        return storage_block_ids

    def wait_prefetch_storage_task(self, req_id):
        if req_id not in self.task_prefetch_event:
            return None
        self.task_prefetch_event[req_id].wait()
        storage_block_ids = self.storage_prefetch_block_ids[req_id]
        del self.task_prefetch_event[req_id]
        del self.storage_prefetch_block_ids[req_id]
        return storage_block_ids

    def recv_data_transfer_result(self):
        """The receiver thread (upstream: `while True`)."""
        while not self._stop.is_set():
            data = self.cache_task_queue.get_transfer_done_signal()
            if data is None:
                time.sleep(0.001)
                continue
            event_type = data[0]
            if event_type.value == CacheStatus.STORAGE2GPU.value:
                task_id, _hash_keys, block_ids = data[1:]
                if task_id not in self.storage_prefetch_block_ids:
                    self.storage_prefetch_block_ids[task_id] = []
                saved_block_ids = self.storage_prefetch_block_ids[task_id]
                saved_block_ids.append(block_ids)
                if len(saved_block_ids) == self.tensor_parallel_size:
                    self.storage_prefetch_block_ids[task_id] = min(saved_block_ids, key=len)
                    if task_id in self.task_prefetch_event:
                        self.task_prefetch_event[task_id].set()
            elif event_type.value == CacheStatus.GPU2STORAGE.value:
                task_id, _hash_keys, _block_ids = data[1:]
                if task_id in self.task_write_back_event:
                    self.task_write_back_event[task_id].set()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.recv_data_transfer_result, daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
