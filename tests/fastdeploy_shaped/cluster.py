"""A FastDeploy-shaped storage cache, running: the engine's PrefixCacheManager with its receiver thread,
one CacheTransferManager per tensor-parallel rank with its loop, their shared queue and one storage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastdeploy_shaped.cache_data import ReadStorageTask, WriteStorageTask
from fastdeploy_shaped.cache_queue import CacheQueueServer, EngineCacheQueue
from fastdeploy_shaped.cache_transfer_manager import CacheTransferManager
from fastdeploy_shaped.prefix_cache_manager import PrefixCacheManager
from fastdeploy_shaped.storage import DictStore
from fastdeploy_shaped.tensors import view, zeros

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 2, 16, 2, 4, 8


@dataclass
class StorageCluster:
    server: CacheQueueServer
    engine: PrefixCacheManager
    ranks: list[CacheTransferManager]
    store: DictStore
    threads: list = field(default_factory=list)

    def start(self) -> StorageCluster:
        self.threads = [self.engine.start()] + [rank.start() for rank in self.ranks]
        return self

    def stop(self) -> None:
        self.store.release.set()
        self.engine.stop()
        for rank in self.ranks:
            rank.stop()
        for thread in self.threads:
            thread.join(timeout=5)

    def fill(self, keys: list[str], value: float = 1.0, ranks: Any = None) -> None:
        """Store one block per key for each rank (all layers, keys and values), every element `value`."""
        for rank in ranks if ranks is not None else range(len(self.ranks)):
            for key in keys:
                block = np.full((LAYERS, HEADS, BLOCK_SIZE, HEAD_DIM), value, np.float16)
                self.store.blocks[f"prefix_{key}_{rank}_key"] = block
                self.store.blocks[f"prefix_{key}_{rank}_value"] = block.copy()

    def gpu(self, rank: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """NumPy views of a rank's GPU cache tensors (per layer: keys, values)."""
        r = self.ranks[rank]
        return [view(t) for t in r.gpu_cache_k_tensors], [view(t) for t in r.gpu_cache_v_tensors]

    def poison(self, block_id: int, rank: int = 0, value: float = float("nan")) -> None:
        keys, _ = self.gpu(rank)
        keys[-1][block_id, 0, 0, 0] = value


def make_cluster(n_ranks: int = 1, barrier_timeout: float | None = None) -> StorageCluster:
    server = CacheQueueServer(n_ranks, barrier_timeout=barrier_timeout)
    store = DictStore()
    engine = PrefixCacheManager(EngineCacheQueue(server), tensor_parallel_size=n_ranks)
    shape = [BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM]
    ranks = [
        CacheTransferManager(rank, n_ranks, EngineCacheQueue(server, rank), [zeros(shape) for _ in range(LAYERS)],
                             [zeros(shape) for _ in range(LAYERS)], store, BLOCK_SIZE)
        for rank in range(n_ranks)
    ]
    return StorageCluster(server, engine, ranks, store)


def read_task(task_id: str, keys: list[str], gpu_block_ids: list[int]) -> ReadStorageTask:
    return ReadStorageTask(task_id=task_id, keys=keys, token_ids=None, gpu_block_ids=gpu_block_ids,
                           start_read_block_idx=0)


def write_task(task_id: str, keys: list[str], gpu_block_ids: list[int]) -> WriteStorageTask:
    return WriteStorageTask(task_id=task_id, keys=keys, token_ids=None, gpu_block_ids=gpu_block_ids)
