"""Guard a FastDeploy-shaped PrefixCacheManager's storage paths with kvobs.

The two methods keep their engine signatures: `issue_prefetch_storage_task(task, is_sync=True)` and
`issue_write_back_storage_task(task, is_sync=True)`, with tasks carrying `task_id`, `keys` and
`gpu_block_ids`. The decorators add, without touching the method bodies:

- validation before any lock (bad block ids, key/block mismatch, is_sync=False) as TransferRejected;
- the cache lock, timed and released in try/finally (the GPU worker takes the same `obs.lock` around its
  forward pass);
- a NaN/Inf check of exactly the touched blocks: before a write-back, after a prefetch;
- metrics (kvobs_transfers_total, kvobs_lock_wait_seconds, ...), spans and logs.

Run: python examples/prefix_cache_manager.py
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

import kvobs
from kvobs.integrity import CorruptKVError

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 64, 16, 4, 32

registry = CollectorRegistry()  # an application would usually keep prometheus_client's default registry
obs = kvobs.KVObserver(
    "prefix-cache-example",
    # `timeout` bounds `with obs.lock:` too; kvobs.ProcessLock("kv_cache") when the forward pass is another process
    lock=kvobs.ThreadLock("kv_cache", timeout=5.0),
    lock_timeout=5.0,
    registry=registry,
    capacity=NUM_BLOCKS,
    integrity={"prefetch": "raise", "write_back": "skip", "send": "skip"},
)


@dataclass
class StorageTask:
    task_id: str
    keys: list[str]
    gpu_block_ids: list[int]


class PrefixCacheManager:
    def __init__(self) -> None:
        # The engine's GPU cache; a NumPy array here, checked the same way as a torch or Paddle tensor.
        self.gpu_cache = np.zeros((NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM), dtype=np.float16)
        self.storage: dict[str, np.ndarray] = {}

    @obs.prefetch(keys="task.keys", block_ids="task.gpu_block_ids", sync="is_sync", cache="self.gpu_cache")
    def issue_prefetch_storage_task(self, task: StorageTask, is_sync: bool = True) -> int:
        for key, block in zip(task.keys, task.gpu_block_ids):
            self.gpu_cache[block] = self.storage[key]
        return len(task.keys)

    @obs.write_back(keys="task.keys", block_ids="task.gpu_block_ids", sync="is_sync", cache="self.gpu_cache")
    def issue_write_back_storage_task(self, task: StorageTask, is_sync: bool = True) -> int:
        for key, block in zip(task.keys, task.gpu_block_ids):
            self.storage[key] = self.gpu_cache[block].copy()
        return len(task.keys)


def main() -> None:
    rng = np.random.default_rng(0)
    manager = PrefixCacheManager()
    manager.gpu_cache[0:4] = rng.standard_normal(manager.gpu_cache[0:4].shape)

    # A clean write-back, then a prefix hit that prefetches the same keys into other blocks.
    wrote = manager.issue_write_back_storage_task(StorageTask("req-1", ["k0", "k1", "k2", "k3"], [0, 1, 2, 3]))
    read = manager.issue_prefetch_storage_task(StorageTask("req-2", ["k0", "k1", "k2", "k3"], [8, 9, 10, 11]))
    print(f"write-back stored {wrote} blocks, prefetch loaded {read} blocks")

    # Block 5 holds NaN (say, reallocated and not yet written): the write-back is refused, nothing is stored.
    manager.gpu_cache[5] = float("nan")
    result = manager.issue_write_back_storage_task(StorageTask("req-3", ["k4", "k5"], [4, 5]))
    print(f"write-back of a NaN block returned {result!r}; 'k5' stored: {'k5' in manager.storage}")

    # A poisoned storage entry is caught on prefetch: the engine treats it as a miss and recomputes.
    manager.storage["k1"] = np.full_like(manager.storage["k1"], np.nan)
    try:
        manager.issue_prefetch_storage_task(StorageTask("req-4", ["k0", "k1"], [12, 13]))
    except CorruptKVError as exc:
        print(f"prefetch refused: {exc}")

    # Unsupported modes and bad arguments are rejected before the lock, also under `python -O`.
    try:
        manager.issue_write_back_storage_task(StorageTask("req-5", ["k6"], [6]), is_sync=False)
    except kvobs.TransferRejected as exc:
        print(f"rejected: {exc}")

    # The GPU worker's forward pass takes the same lock around execute_model (LockTimeout after 5 s).
    with obs.lock:
        manager.gpu_cache[6] = rng.standard_normal(manager.gpu_cache[6].shape)

    wanted = ("kvobs_transfers_total{", "kvobs_nan_checks_total{")
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(wanted) and not line.endswith(" 0.0"):
            print(line)


if __name__ == "__main__":
    main()
