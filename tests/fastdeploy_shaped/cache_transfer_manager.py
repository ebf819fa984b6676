"""`CacheTransferManager`'s storage paths (upstream: cache_manager/cache_transfer_manager.py).

One per tensor-parallel rank. `do_data_transfer` hands each storage task to a one-thread pool (the future is
never looked at). `read_storage_task` matches keys in storage, copies the matched blocks in
`_run_read_storage` (which returns the blocks that really loaded: a prefix), then every rank meets at
`swap_storage_to_gpu_barrier` and every rank sends a done signal. `write_back_storage_task` writes the
blocks storage lacks in `_run_write_back_storage`, every rank meets at `swap_to_storage_barrier`, and rank 0
alone sends the done signal. Exceptions in either are logged and swallowed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any

import numpy as np

from fastdeploy_shaped.cache_data import CacheStatus, ReadStorageTask, WriteStorageTask
from fastdeploy_shaped.tensors import view

logger = logging.getLogger("fastdeploy_shaped.cache_transfer_manager")


class CacheTransferManager:
    def __init__(self, rank: int, n_ranks: int, cache_task_queue: Any, gpu_cache_k_tensors: list,
                 gpu_cache_v_tensors: list, storage_backend: Any, block_size: int) -> None:
        self.rank = rank
        self.n_ranks = n_ranks
        self.cache_task_queue = cache_task_queue
        self.gpu_cache_k_tensors = gpu_cache_k_tensors
        self.gpu_cache_v_tensors = gpu_cache_v_tensors
        self.storage_backend = storage_backend
        self.storage_backend_type = "file"
        self.block_size = block_size
        self.key_prefix = ""
        self.has_cache_scale = False
        self.read_storage_thread_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.write_back_storage_thread_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self._stop = threading.Event()

    # -- the storage copies ------------------------------------------------------------------------------

    def _run_read_storage(self, task_id: str, token_ids: list[int], start_read_block_idx: int,
                          k_cache_keys: list[str], v_cache_keys: list[str], k_scale_keys: list[str],
                          v_scale_keys: list[str], gpu_block_ids: list[int], cpu_block_ids: list[int],
                          timeout: float):
        try:
            block_num = len(gpu_block_ids)
            result = self.storage_backend.batch_get(k_cache_keys + v_cache_keys)
            k_result, v_result = result[:block_num], result[block_num : 2 * block_num]
            success_block_num = 0
            for k, v in zip(k_result, v_result):
                if k is None or v is None:
                    break
                success_block_num += 1
            valid_gpu_block_ids = gpu_block_ids[:success_block_num]
            _swap_into(self.gpu_cache_k_tensors, valid_gpu_block_ids, k_result)  # swap_cache_layout, mode 1
            _swap_into(self.gpu_cache_v_tensors, valid_gpu_block_ids, v_result)
            return valid_gpu_block_ids
        except Exception as e:
            logger.error(f"An error occurred in _run_read_storage, error: {e}")
            raise

    def _run_write_back_storage(self, task_id, token_ids, start_write_block_idx, k_cache_keys, v_cache_keys,
                                k_scale_keys, v_scale_keys, gpu_block_ids, cpu_block_ids, timeout):
        try:
            k_values = _swap_out(self.gpu_cache_k_tensors, gpu_block_ids)  # swap_cache_layout, mode 0
            v_values = _swap_out(self.gpu_cache_v_tensors, gpu_block_ids)
            self.storage_backend.batch_set(k_cache_keys + v_cache_keys, k_values + v_values)
            return len(gpu_block_ids)
        except Exception as e:  # noqa: BLE001 - upstream swallows and logs
            logger.error(f"An error occurred in _run_write_back_storage, error: {e}")
            return 0

    # -- the tasks, in the pool threads -------------------------------------------------------------------

    def _storage_keys(self, keys: list[str]) -> tuple[list[str], list[str]]:
        return ([f"prefix{self.key_prefix}_{key}_{self.rank}_key" for key in keys],
                [f"prefix{self.key_prefix}_{key}_{self.rank}_value" for key in keys])

    def read_storage_task(self, task: ReadStorageTask):
        assert self.storage_backend, "storage_backend not initialized"
        try:
            gpu_block_ids = task.gpu_block_ids.copy()
            cpu_block_ids = [i for i in range(len(gpu_block_ids))]
            k_cache_keys, v_cache_keys = self._storage_keys(task.keys)
            match_block_num = self.storage_backend.query(k_cache_keys, v_cache_keys, None, None, task.timeout)
            k_cache_keys, v_cache_keys = k_cache_keys[:match_block_num], v_cache_keys[:match_block_num]
            gpu_block_ids, cpu_block_ids = gpu_block_ids[:match_block_num], cpu_block_ids[:match_block_num]
            valid_gpu_block_ids = []
            if match_block_num > 0:
                try:
                    valid_gpu_block_ids = self._run_read_storage(
                        task.task_id, task.token_ids, task.start_read_block_idx, k_cache_keys, v_cache_keys,
                        None, None, gpu_block_ids, cpu_block_ids, task.timeout)
                except Exception as e:  # noqa: BLE001 - upstream swallows and logs
                    logger.error(f"Failed to read cache for task {task.task_id}, error: {e}")
                    valid_gpu_block_ids = []
            result = (CacheStatus.STORAGE2GPU, task.task_id, task.keys, valid_gpu_block_ids)
            self.cache_task_queue.swap_storage_to_gpu_barrier.wait()
            self.cache_task_queue.swap_storage_to_gpu_barrier.reset()
            self.cache_task_queue.put_transfer_done_signal(result)
        except Exception as e:  # noqa: BLE001 - upstream swallows and logs
            logger.error(f"An error occurred in read_storage_task: task_id: {task.task_id}, error:{e!r}")

    def write_back_storage_task(self, task: WriteStorageTask):
        assert self.storage_backend, "storage_backend not initialized"
        try:
            gpu_block_ids = task.gpu_block_ids.copy()
            cpu_block_ids = [i for i in range(len(gpu_block_ids))]
            k_cache_keys, v_cache_keys = self._storage_keys(task.keys)
            match_block_num = self.storage_backend.query(k_cache_keys, v_cache_keys, None, None, task.timeout)
            if match_block_num >= len(k_cache_keys):
                gpu_block_ids = []
            else:
                try:
                    gpu_block_ids = gpu_block_ids[match_block_num:]
                    self._run_write_back_storage(
                        task.task_id, task.token_ids, match_block_num, k_cache_keys[match_block_num:],
                        v_cache_keys[match_block_num:], None, None, gpu_block_ids,
                        cpu_block_ids[match_block_num:], task.timeout)
                except Exception as e:  # noqa: BLE001 - upstream swallows and logs
                    logger.error(f"Error in write back storage task: {e}")
                    gpu_block_ids = []
            result = (CacheStatus.GPU2STORAGE, task.task_id, task.keys, gpu_block_ids)
            self.cache_task_queue.swap_to_storage_barrier.wait()
            if self.rank == 0:
                self.cache_task_queue.swap_to_storage_barrier.reset()
                self.cache_task_queue.put_transfer_done_signal(result)
        except Exception as e:  # noqa: BLE001 - upstream swallows and logs
            logger.error(f"An error occurred in write_back_storage_task, error: {e!r}")

    # -- the loop -----------------------------------------------------------------------------------------

    def do_data_transfer(self):
        """Hands tasks to the pools. Upstream loops `while True` and also aligns the ranks (a broadcast flag,
        barrier1/barrier3) before reading a task; the one-thread pools and their unread futures are kept."""
        while not self._stop.is_set():
            data, _read_finish = self.cache_task_queue.get_transfer_task()
            if data is None:
                time.sleep(0.001)
                continue
            event_type, event_args = data[0], data[1:]
            if event_type.value == CacheStatus.STORAGE2GPU.value:
                self.read_storage_thread_pool.submit(self.read_storage_task, event_args[0])
            elif event_type.value == CacheStatus.GPU2STORAGE.value:
                self.write_back_storage_thread_pool.submit(self.write_back_storage_task, event_args[0])

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.do_data_transfer, daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
        self.read_storage_thread_pool.shutdown(wait=False, cancel_futures=True)
        self.write_back_storage_thread_pool.shutdown(wait=False, cancel_futures=True)


def _swap_into(layers: list, block_ids: list[int], blocks: list) -> None:
    """Storage blocks ([layers, ...] each) into the per-layer GPU tensors."""
    for layer, tensor in enumerate(layers):
        dst = view(tensor)
        for block_id, block in zip(block_ids, blocks):
            dst[block_id] = block[layer]


def _swap_out(layers: list, block_ids: list[int]) -> list:
    return [np.stack([view(tensor)[block_id] for tensor in layers]) for block_id in block_ids]
