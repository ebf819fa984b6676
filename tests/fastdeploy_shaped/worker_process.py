"""`PaddleDisWorkerProc` (upstream: worker/worker_process.py): the GPU worker's event loop takes the
GPU-cache lock around `execute_model` on tensor-parallel rank 0, when `FD_USE_KVCACHE_LOCK` is set."""

from __future__ import annotations

import types
from typing import Any

from fastdeploy_shaped.ipc_signal import IPCLock


class GpuWorker:
    """Stands in for `GpuWorker`: records each step, and can run a callback inside it (a test's probe)."""

    def __init__(self) -> None:
        self.steps: list[tuple[Any, Any]] = []
        self.during_step = None

    def execute_model(self, model_forward_batch=None, num_running_requests: int | None = None):
        if self.during_step is not None:
            self.during_step()
        self.steps.append((model_forward_batch, num_running_requests))


class PaddleDisWorkerProc:
    def __init__(self, local_rank: int, tensor_parallel_size: int, port: int, lock_dir: str | None = None,
                 use_kvcache_lock: bool = True) -> None:
        self.local_rank = local_rank
        self.parallel_config = types.SimpleNamespace(tensor_parallel_size=tensor_parallel_size,
                                                     local_engine_worker_queue_port=port)
        self.worker = GpuWorker()
        self.use_kvcache_lock = use_kvcache_lock  # envs.FD_USE_KVCACHE_LOCK
        self._lock_dir = lock_dir

    def init_health_status(self) -> None:
        self.gpu_cache_lock = IPCLock(name="gpu_cache_lock", suffix=self.parallel_config.local_engine_worker_queue_port,
                                      create=False, lock_dir=self._lock_dir)

    def _acquire_kvcache_lock(self, tp_rank):
        if not self.use_kvcache_lock:
            return
        if tp_rank == 0:
            self.gpu_cache_lock.acquire()

    def _release_kvcache_lock(self, tp_rank):
        if not self.use_kvcache_lock:
            return
        if tp_rank == 0:
            self.gpu_cache_lock.release()

    def event_loop_step(self, req_dicts: Any, max_occupied_batch_index: int) -> None:
        """One turn of `event_loop_normal` (no try/finally upstream either)."""
        tp_rank = self.local_rank % self.parallel_config.tensor_parallel_size
        self._acquire_kvcache_lock(tp_rank)
        self.worker.execute_model(req_dicts, max_occupied_batch_index)
        self._release_kvcache_lock(tp_rank)
