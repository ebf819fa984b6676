"""`CacheMessagerV1` on a prefill node (upstream: cache_manager/cache_messager.py, before the early-signal fix).

Three threads: `consume_signals` reads the model runner's layer signals (`get_output_kv_signal`, a module
function) and, on layer 0, queues the batch slots whose send may start; `_add_cache_task_thread` registers
a request's task when the decode node's block ids arrive; `prefill_layerwise_send_cache_thread` sends each
queued batch layer by layer with `IPCCommManager.write_cache`, then reports the request finished.
`RUNNER_SIGNALS` holds what the model runner reported, per rank id (see `runner_signal`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from fastdeploy_shaped.engine_worker_queue import EngineWorkerQueue
from fastdeploy_shaped.ipc_cache_transfer import IPCCommManager
from fastdeploy_shaped.send_thread import LayerwiseSender
from fastdeploy_shaped.tensors import full, view

logger = logging.getLogger("fastdeploy_shaped.cache_messager")
RUNNER_SIGNALS: dict[int, queue.Queue] = {}
READS: dict[int, int] = {}  # calls of get_output_kv_signal begun, per rank id (tests wait on it)
WORKER_QUEUES: dict[int, Any] = {}  # engine_worker_queue_port -> WorkerQueueServer


def runner_signal(rank_id: int, layer: int, entries: list[tuple[int, int, int]]) -> None:
    """The model runner reports `layer` done for (slot, chunk token offset, chunk length) entries."""
    RUNNER_SIGNALS.setdefault(rank_id, queue.Queue()).put((layer, entries))


def get_output_kv_signal(kv_signal_data: Any, rank_id: int, wait_flag: int) -> None:
    """Fill the signal array in place: [count, layer, (slot, offset, length) * count]; count -1 when none."""
    READS[rank_id] = READS.get(rank_id, 0) + 1
    data = view(kv_signal_data)
    try:
        layer, entries = RUNNER_SIGNALS.setdefault(rank_id, queue.Queue()).get(timeout=0.005)
    except queue.Empty:
        data[0] = -1
        return
    data[0], data[1] = len(entries), layer
    for i, entry in enumerate(entries):
        data[3 * i + 2 : 3 * i + 5] = entry


class CacheMessagerV1(LayerwiseSender):
    def __init__(self, splitwise_role, transfer_protocol, pod_ip, engine_worker_queue_port, local_data_parallel_id,
                 gpu_cache_kvs, rank, nranks, num_layers, gpu_id=0, block_size=64, rdma_port=None):
        self.splitwise_role = splitwise_role
        self.gpu_cache_kvs = gpu_cache_kvs
        self.rank = rank
        self.nranks = nranks
        self.engine_worker_queue = EngineWorkerQueue(WORKER_QUEUES[engine_worker_queue_port], client_id=rank)
        self.block_size = block_size
        self.num_layers = num_layers
        cache_k = [gpu_cache_kvs[f"key_caches_{i}_rank{rank}_device{gpu_id}"] for i in range(num_layers)]
        cache_v = [gpu_cache_kvs[f"value_caches_{i}_rank{rank}_device{gpu_id}"] for i in range(num_layers)]
        self.messager = {"ipc": IPCCommManager(self.rank, gpu_id, cache_k, cache_v)}
        self.gpu_id = gpu_id
        self.cache_info = {}
        self.rank_id = self.rank + local_data_parallel_id * self.nranks
        self.engine_cache_task_thread_lock = threading.Lock()
        self.engine_cache_tasks = [{} for _ in range(512)]
        self.idx_cache_task_dict = {}
        self.cache_prefilled_engine_ids_queue = queue.Queue()
        self._stop = threading.Event()
        self.threads = []
        if splitwise_role == "prefill":
            for target in (self.consume_signals, self._add_cache_task_thread):
                self.threads.append(threading.Thread(target=target, daemon=True))
                self.threads[-1].start()

    def stop(self) -> None:
        self._stop.set()

    def _add_cache_task_thread(self):
        while not self._stop.is_set():
            try:
                cache_info = self.engine_worker_queue.get_cache_info()
                finished_add_cache_task_req_ids = []
                if cache_info:
                    self.engine_worker_queue.cache_info_barrier.wait()
                    for info in cache_info:
                        if info["request_id"] in self.cache_info:
                            self._complete_task(info)
                            finished_add_cache_task_req_ids.append(info["request_id"])
                        else:
                            self.cache_info[info["request_id"]] = info
                    if finished_add_cache_task_req_ids:
                        self.engine_worker_queue.put_finished_add_cache_task_req(finished_add_cache_task_req_ids)
                    self.engine_worker_queue.finish_add_cache_task_barrier.wait()
                else:
                    time.sleep(0.001)
            except Exception as e:  # noqa: BLE001 - upstream swallows and logs
                logger.info(f"add cache task occured error: {e!r}")

    def _complete_task(self, info: dict) -> None:
        """The second info of a request (from the decode node) completes its task: registered by slot."""
        self.cache_info[info["request_id"]].update(info)
        current_info = self.cache_info[info["request_id"]]
        assert "dest_block_ids" in current_info and "src_block_ids" in current_info
        decode_cached_block_num = len(current_info["src_block_ids"]) - len(current_info["dest_block_ids"])
        current_info["dest_block_ids"] = [-1] * decode_cached_block_num + current_info["dest_block_ids"]
        current_info["decode_cached_tokens"] = decode_cached_block_num * self.block_size
        current_info["sended_layer_id"] = -1
        current_info["sended_block_num"] = current_info["decode_cached_tokens"] // self.block_size
        current_info["status"] = "init"
        self.cache_info[info["request_id"]] = current_info
        self.idx_cache_task_dict[current_info["current_id"]] = current_info

    def consume_signals(self):
        kv_signal_data = full([512 * 3 + 2], -1, "int32")
        while not self._stop.is_set():
            try:
                get_output_kv_signal(kv_signal_data, self.rank_id, 0)
                if not self.cache_info:
                    time.sleep(0.01)
                    continue
                tasks_count = int(kv_signal_data[0])
                if tasks_count == -1:
                    time.sleep(0.001)
                    continue
                layer_id = int(kv_signal_data[1])
                batch_engine_signals = []
                with self.engine_cache_task_thread_lock:
                    for bi in range(tasks_count):
                        engine_idx = int(kv_signal_data[3 * bi + 2])
                        chuck_token_offset = int(kv_signal_data[3 * bi + 3])
                        current_seq_len = int(kv_signal_data[3 * bi + 4])
                        self.engine_cache_tasks[engine_idx]["prefilled_layer_idx"] = layer_id
                        self.engine_cache_tasks[engine_idx]["prefilled_token_num"] = chuck_token_offset + current_seq_len
                        batch_engine_signals.append((engine_idx, chuck_token_offset + current_seq_len))
                    if layer_id == 0:
                        self.cache_prefilled_engine_ids_queue.put(batch_engine_signals)
            except Exception as e:  # noqa: BLE001 - upstream swallows and logs
                logger.error(f"Consume signals get exception: {e!r}")
