"""Put kvobs on FastDeploy's storage cache: the engine's PrefixCacheManager and a CacheTransferManager.

FastDeploy's engine issues storage tasks (`issue_prefetch_storage_task` / `issue_write_back_storage_task`);
a cache transfer process per tensor-parallel rank copies the blocks between storage and its GPU cache in a
pool thread and answers with a done signal. kvobs, in two lines per process:

    kvfd.instrument_prefix_cache_manager(prefix_cache_manager, engine_obs)   # engine: issue -> done signal
    kvfd.instrument_cache_transfer_manager(cache_transfer_manager, rank_obs) # each rank: the copy, checked

Below, small stand-ins with FastDeploy's method names and control flow play both processes (threads here),
so the example runs without FastDeploy or a GPU: a partial storage hit loads fewer blocks and raises no
alarm, a poisoned storage entry is reported as "nothing loaded" (the engine recomputes), a NaN block is
never written back, and the engine never hangs on a missing done signal.

Run: python examples/fastdeploy_storage_cache.py
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from dataclasses import dataclass
from enum import Enum

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

import kvobs
from kvobs.integrations import fastdeploy as kvfd

BLOCKS, LAYERS, BLOCK_SHAPE = 16, 2, (2, 4, 8)  # per layer: [blocks, heads, block_size, head_dim]


class CacheStatus(Enum):
    STORAGE2GPU = 4
    GPU2STORAGE = 5


@dataclass(frozen=True, kw_only=True)
class StorageTask:
    task_id: str
    keys: list[str]
    gpu_block_ids: list[int]
    token_ids: list[int] | None = None


class CacheTaskQueue:
    def __init__(self) -> None:
        self.tasks: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()

    def put_transfer_task(self, item) -> None:
        self.tasks.put(item)

    def put_transfer_done_signal(self, item) -> None:
        self.done.put(item)

    def get_transfer_done_signal(self):
        try:
            return self.done.get(timeout=0.01)
        except queue.Empty:
            return None


class PrefixCacheManager:
    """The engine side: issue a task, wait for its done signal (set by the receiver thread)."""

    def __init__(self, cache_task_queue: CacheTaskQueue) -> None:
        self.cache_task_queue = cache_task_queue
        self.tensor_parallel_size = 1
        self.kvcache_storage_backend = "file"
        self.events: dict[str, threading.Event] = {}
        self.results: dict[str, list[int]] = {}
        threading.Thread(target=self.recv_data_transfer_result, daemon=True).start()

    def issue_prefetch_storage_task(self, task: StorageTask, is_sync=True):
        self.events[task.task_id] = threading.Event()
        self.cache_task_queue.put_transfer_task((CacheStatus.STORAGE2GPU, task))
        self.events[task.task_id].wait()
        return self.results.pop(task.task_id)

    def issue_write_back_storage_task(self, task: StorageTask, is_sync=True):
        self.events[task.task_id] = threading.Event()
        self.cache_task_queue.put_transfer_task((CacheStatus.GPU2STORAGE, task))
        self.events[task.task_id].wait()

    def recv_data_transfer_result(self):
        while True:
            data = self.cache_task_queue.get_transfer_done_signal()
            if data is not None:
                self.results[data[1]] = data[3]
                self.events[data[1]].set()


class CacheTransferManager:
    """A rank's transfer process: copies in a one-thread pool, then always sends the done signal."""

    def __init__(self, cache_task_queue: CacheTaskQueue, storage: dict) -> None:
        self.cache_task_queue = cache_task_queue
        self.storage = storage
        self.gpu_cache_k_tensors = [np.zeros((BLOCKS, *BLOCK_SHAPE), np.float16) for _ in range(LAYERS)]
        self.gpu_cache_v_tensors = [np.zeros((BLOCKS, *BLOCK_SHAPE), np.float16) for _ in range(LAYERS)]
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        threading.Thread(target=self.do_data_transfer, daemon=True).start()

    def _run_read_storage(self, task_id, token_ids, start_read_block_idx, k_cache_keys, v_cache_keys,
                          k_scale_keys, v_scale_keys, gpu_block_ids, cpu_block_ids, timeout):
        loaded = 0
        for key, block in zip(k_cache_keys, gpu_block_ids):
            if key not in self.storage:
                break
            for layer in range(LAYERS):
                self.gpu_cache_k_tensors[layer][block] = self.storage[key][layer]
                self.gpu_cache_v_tensors[layer][block] = self.storage[key][layer]
            loaded += 1
        return gpu_block_ids[:loaded]

    def _run_write_back_storage(self, task_id, token_ids, start_write_block_idx, k_cache_keys, v_cache_keys,
                                k_scale_keys, v_scale_keys, gpu_block_ids, cpu_block_ids, timeout):
        for key, block in zip(k_cache_keys, gpu_block_ids):
            self.storage[key] = np.stack([t[block] for t in self.gpu_cache_k_tensors])
        return len(gpu_block_ids)

    def read_storage_task(self, task: StorageTask):
        keys = task.keys
        try:
            loaded = self._run_read_storage(task.task_id, None, 0, keys, keys, None, None,
                                            task.gpu_block_ids[:len(keys)], list(range(len(keys))), 30.0)
        except Exception as exc:  # as FastDeploy: a failed read loads nothing (kvobs fails a corrupt one so)
            print(f"read of {task.task_id} failed: {exc}")
            loaded = []
        self.cache_task_queue.put_transfer_done_signal((CacheStatus.STORAGE2GPU, task.task_id, keys, loaded))

    def write_back_storage_task(self, task: StorageTask):
        keys, ids = task.keys, task.gpu_block_ids
        self._run_write_back_storage(task.task_id, None, 0, keys, keys, None, None, ids, list(range(len(ids))), 30.0)
        self.cache_task_queue.put_transfer_done_signal((CacheStatus.GPU2STORAGE, task.task_id, keys, ids))

    def do_data_transfer(self):
        while True:
            status, task = self.cache_task_queue.tasks.get()
            run = self.read_storage_task if status is CacheStatus.STORAGE2GPU else self.write_back_storage_task
            self.pool.submit(run, task)


def main() -> None:
    registry = CollectorRegistry()
    engine_obs = kvobs.KVObserver("fd-engine", registry=registry, lock=None)  # no KV tensors: spans, counts
    rank_obs = kvobs.KVObserver("fd-rank0", registry=registry, capacity=BLOCKS, block_bytes=2 * 2 * 64 * 2,
                                deadline=5.0)  # pass lock=kvfd.FastDeployLock(port) to share FastDeploy's lock
    tasks, storage = CacheTaskQueue(), {}
    engine, rank = PrefixCacheManager(tasks), CacheTransferManager(tasks, storage)
    undo = [kvfd.instrument_prefix_cache_manager(engine, engine_obs),
            kvfd.instrument_cache_transfer_manager(rank, rank_obs)]

    for layer in rank.gpu_cache_k_tensors:
        layer[0:3] = 1.5
    engine.issue_write_back_storage_task(StorageTask(task_id="req-1", keys=["h0", "h1", "h2"], gpu_block_ids=[0, 1, 2]))
    print(f"write-back stored: {sorted(storage)}")

    rank.gpu_cache_k_tensors[0][8:13] = np.nan  # freshly allocated blocks hold garbage until loaded
    loaded = engine.issue_prefetch_storage_task(
        StorageTask(task_id="req-2", keys=["h0", "h1", "h2", "h3"], gpu_block_ids=[8, 9, 10, 11, 12]))
    print(f"partial hit: 4 keys for 5 blocks, storage had 3: loaded {loaded}, no false alarm")

    storage["h1"][1, 0, 0, 0] = np.nan  # a poisoned storage entry
    loaded = engine.issue_prefetch_storage_task(StorageTask(task_id="req-3", keys=["h0", "h1"], gpu_block_ids=[4, 5]))
    print(f"poisoned storage entry: loaded {loaded} (nothing loaded: the engine recomputes)")

    rank.gpu_cache_k_tensors[1][6, 0, 0, 0] = np.inf
    engine.issue_write_back_storage_task(StorageTask(task_id="req-4", keys=["h6", "h7"], gpu_block_ids=[6, 7]))
    print(f"write-back of an Inf block returned (no hang); stored: {'h6' in storage or 'h7' in storage}")

    for u in undo:
        u()
    wanted = ("kvobs_transfers_total{", "kvobs_nan_checks_total{", "kvobs_transfer_blocks_total{")
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(wanted) and not line.endswith(" 0.0"):
            print(line)


if __name__ == "__main__":
    main()
