"""A FastDeploy-shaped prefill node, running: one CacheMessagerV1 per tensor-parallel rank (its signal, task and
send threads), the engine's worker-queue client, and the decode node's GPU caches the sends write into."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
from support import wait_until

from fastdeploy_shaped import cache_messager
from fastdeploy_shaped.cache_messager import CacheMessagerV1, runner_signal
from fastdeploy_shaped.engine_worker_queue import EngineWorkerQueue, WorkerQueueServer
from fastdeploy_shaped.ipc_cache_transfer import DECODE_CACHES
from fastdeploy_shaped.tensors import view, zeros

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 3, 16, 2, 4, 8
DECODE_GPU = 7


@dataclass
class PrefillNode:
    server: WorkerQueueServer
    engine_queue: EngineWorkerQueue
    messagers: list[CacheMessagerV1]
    threads: list[threading.Thread] = field(default_factory=list)

    def start_sending(self) -> None:
        for m in self.messagers:
            self.threads.append(threading.Thread(target=m.prefill_layerwise_send_cache_thread, daemon=True))
            self.threads[-1].start()

    def stop(self) -> None:
        for m in self.messagers:
            m.stop()
        for t in self.threads + [t for m in self.messagers for t in m.threads]:
            t.join(timeout=5)

    def prefill_info(self, request_id: str, slot: int, src: list[int], tokens: int) -> None:
        """The prefill engine hands the request's blocks to its messagers."""
        self.engine_queue.put_cache_info([{"request_id": request_id, "src_block_ids": src, "current_id": slot,
                                           "need_prefill_tokens": tokens}])
        wait_until(lambda: all(request_id in m.cache_info for m in self.messagers))

    def decode_info(self, request_id: str, dest: list[int]) -> None:
        """The decode node's allocated blocks arrive: the messagers register the request's task."""
        self.engine_queue.put_cache_info([{"request_id": request_id, "device_ids": [str(DECODE_GPU)] * len(self.messagers),
                                           "transfer_protocol": "ipc", "dest_block_ids": dest}])

    def run_layers(self, slot: int, tokens: int, layers: range = range(LAYERS), offset: int = 0) -> None:
        """The model runner computes `layers` of the slot's chunk, on every rank. Returns once every rank's
        messager has read them: its slot shows the last layer, or (a registered task) the send already finished
        and the messager cleared the slot."""
        registered = {m.rank_id: slot in m.idx_cache_task_dict for m in self.messagers}
        for layer in layers:
            for m in self.messagers:
                runner_signal(m.rank_id, layer, [(slot, offset, tokens)])

        def read_by(m: CacheMessagerV1) -> bool:
            finished = registered[m.rank_id] and slot not in m.idx_cache_task_dict
            return finished or m.engine_cache_tasks[slot].get("prefilled_layer_idx") == layers[-1]

        wait_until(lambda: all(read_by(m) for m in self.messagers)
                   and all(q.empty() for q in cache_messager.RUNNER_SIGNALS.values()))
        time.sleep(0.03)  # the signal thread is done with the last read

    def settle(self) -> None:
        """Wait until every rank's signal thread began a read after now: a read already in progress when a
        wrapper was installed ran unwrapped."""
        begun = {m.rank_id: cache_messager.READS.get(m.rank_id, 0) for m in self.messagers}
        wait_until(lambda: all(cache_messager.READS.get(r, 0) > n for r, n in begun.items()))

    def finished(self, within: float = 60.0) -> list:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            done = self.engine_queue.get_finished_req()
            if done:
                return done
            time.sleep(0.005)
        return []

    def prefill_cache(self, rank: int = 0) -> list[np.ndarray]:
        m = self.messagers[rank]
        return [view(m.gpu_cache_kvs[f"key_caches_{i}_rank{rank}_device{rank}"]) for i in range(LAYERS)]

    def decode_cache(self, rank: int = 0) -> list[np.ndarray]:
        return [view(t) for t in DECODE_CACHES[(rank, DECODE_GPU)][0]]


def prefill_node(n_ranks: int = 1, port: int = 9001) -> PrefillNode:
    server = cache_messager.WORKER_QUEUES[port] = WorkerQueueServer(n_ranks, barrier_timeout=10)
    cache_messager.RUNNER_SIGNALS.clear()
    shape = [BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM]
    messagers = []
    for rank in range(n_ranks):
        kvs = {}
        for layer in range(LAYERS):
            for kind in ("key", "value"):
                kvs[f"{kind}_caches_{layer}_rank{rank}_device{rank}"] = tensor = zeros(shape)
                view(tensor)[:] = np.arange(BLOCKS, dtype=np.float16)[:, None, None, None] + layer / 4
        DECODE_CACHES[(rank, DECODE_GPU)] = ([zeros(shape) for _ in range(LAYERS)], [zeros(shape) for _ in range(LAYERS)])
        messagers.append(CacheMessagerV1("prefill", "ipc", "0.0.0.0", port, 0, kvs, rank, n_ranks, LAYERS,
                                         gpu_id=rank, block_size=BLOCK_SIZE))
    return PrefillNode(server, EngineWorkerQueue(server, 0), messagers)
