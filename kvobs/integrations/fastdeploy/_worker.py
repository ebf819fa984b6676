"""The GPU worker process: the cache lock around `execute_model`, where FastDeploy takes it.

FastDeploy's event loop runs `self._acquire_kvcache_lock(tp_rank); self.worker.execute_model(...);
self._release_kvcache_lock(tp_rank)`: the lock is taken on tensor-parallel rank 0 only, blocking, and is
never released if `execute_model` raises. kvobs takes it instead, on the same rank, as a lock holder
(`obs.locked`): timed (LockTimeout instead of a hang), released whatever happens, its waits and holds
measured. FastDeploy's own acquire and release become no-ops while kvobs holds the lock for them: with
kvobs's lock on the same file (`FastDeployLock`) the worker would otherwise wait for itself.
"""

from __future__ import annotations

from typing import Any

from kvobs import Instrumentation, KVObserver, instrument
from kvobs import semconv as sc

LOCKING_RANK = 0  # the tensor-parallel rank whose worker takes FastDeploy's GPU-cache lock


def instrument_worker_process(proc: Any, obs: KVObserver, *, holder: str = sc.HOLDER_FORWARD) -> Instrumentation:
    """Take `obs.lock` around `proc.worker.execute_model` on the locking rank, instead of FastDeploy.

    proc: FastDeploy's `PaddleDisWorkerProc` (its `local_rank`, `parallel_config.tensor_parallel_size`,
    `worker`, `_acquire_kvcache_lock` / `_release_kvcache_lock`). Returns the undo handle. A process already
    instrumented for another observer is refused (`AlreadyInstrumented`).
    """
    tp_rank = proc.local_rank % proc.parallel_config.tensor_parallel_size
    patches = Instrumentation(owner=obs)
    if not patches.claims(proc, "_acquire_kvcache_lock", "_release_kvcache_lock"):
        return patches  # instrumented for this observer already
    patches.replace(proc, "_acquire_kvcache_lock", lambda _: _kvobs_holds("_acquire_kvcache_lock"))
    patches.replace(proc, "_release_kvcache_lock", lambda _: _kvobs_holds("_release_kvcache_lock"))
    if tp_rank == LOCKING_RANK:
        patches.add(instrument(proc.worker, {"execute_model": obs.locked(holder)}))
    return patches


def _kvobs_holds(name: str) -> Any:
    """A no-op in place of FastDeploy's acquire or release: kvobs holds the lock around `execute_model`."""

    def kvcache_lock_held_by_kvobs(tp_rank: int) -> None:
        return None

    kvcache_lock_held_by_kvobs.__name__ = name
    return kvcache_lock_held_by_kvobs
