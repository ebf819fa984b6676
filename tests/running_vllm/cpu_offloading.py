"""An offloading spec for vLLM's OffloadingConnector that copies on the CPU, for the engine tests.

vLLM's own `CPUOffloadingSpec` refuses the CPU platform (its worker copies with GPU kernels). This spec keeps
everything of vLLM's spec but the worker: the scheduler side (which chunks are stored, LRU eviction) is
vLLM's, and the worker copies whole pages between the registered caches and host tensors with torch. Named
the way vLLM lets an out-of-tree spec be named:

    "kv_connector_extra_config": {"spec_name": "CPUCopyOffloadingSpec",
                                  "spec_module_path": "running_vllm.cpu_offloading", "cpu_bytes_to_use": ...}

Copies run on the calling thread, inside `submit_*`, and are reported done by the next `get_finished()`,
so the connector sees them complete after the call that issued them, as with vLLM's worker. `poison_all()`
writes NaN over every stored chunk of every worker in this process: what a corrupt storage tier hands back.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

_workers: weakref.WeakSet[CPUCopyOffloadingWorker] = weakref.WeakSet()


class CPUCopyOffloadingWorker(OffloadingWorker):
    """Host copies of the registered caches, one page per chunk (vLLM's offloaded block = one GPU block)."""

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, num_chunks: int) -> None:
        if blocks_per_chunk != 1:
            raise ValueError(f"CPUCopyOffloadingSpec copies one GPU block per chunk; blocks_per_chunk={blocks_per_chunk}")
        self._device = [t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors]
        self._host = [torch.zeros(num_chunks, d.shape[1], dtype=torch.int8) for d in self._device]
        self._group_tensors = [sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs]
        self._finished: list[TransferResult] = []
        self._lock = threading.Lock()
        _workers.add(self)

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self._copy(job_id, src_spec, dst_spec, to_host=True)
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self._copy(job_id, dst_spec, src_spec, to_host=False)
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy is done when its submit returns

    def poison(self) -> None:
        for host in self._host:
            host.view(torch.float32).fill_(float("nan"))

    def _copy(self, job_id: int, gpu_spec: Any, host_spec: Any, *, to_host: bool) -> None:
        gpu_ids = torch.from_numpy(gpu_spec.block_ids).long()
        chunk_ids = torch.from_numpy(host_spec.block_ids).long()
        sizes = list(getattr(gpu_spec, "group_sizes", None) or [len(gpu_ids)])
        start = 0
        for group, size in enumerate(sizes):
            gpu_part = gpu_ids[start:start + size]
            host_part = chunk_ids[start:start + size]
            start += size
            for index in self._group_tensors[group]:
                if to_host:
                    self._host[index][host_part] = self._device[index][gpu_part]
                else:
                    self._device[index][gpu_part] = self._host[index][host_part]
        with self._lock:
            self._finished.append(TransferResult(job_id=job_id, success=True))


class CPUCopyOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec with a worker that copies on the CPU."""

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        if self._worker is None:
            self._worker = CPUCopyOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker


def poison_all() -> int:
    """NaN over every stored chunk of every worker in this process; how many workers were poisoned."""
    workers = list(_workers)
    for worker in workers:
        worker.poison()
    return len(workers)
