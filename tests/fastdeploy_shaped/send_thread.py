"""`CacheMessagerV1.prefill_layerwise_send_cache_thread` (upstream: cache_manager/cache_messager.py), split into
steps: take a queued batch of (slot, prefilled tokens), send each layer the model runner finished, and after
the last layer report every finished or failed request to the engine."""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

from fastdeploy_shaped.tensors import ids

logger = logging.getLogger("fastdeploy_shaped.cache_messager")


class LayerwiseSender:
    """Mixed into CacheMessagerV1: uses its task tables, queues, barriers and messagers."""

    def prefill_layerwise_send_cache_thread(self):
        while not self._stop.is_set():
            try:
                try:
                    batch_engine_signals = self.cache_prefilled_engine_ids_queue.get(timeout=0.05)
                except queue.Empty:
                    continue  # upstream blocks in get() for ever
                self.engine_worker_queue.begin_send_cache_barrier.wait()
                ranges, token_nums = self._block_ranges(batch_engine_signals)
                self._send_batch(batch_engine_signals, ranges, token_nums)
            except Exception as e:  # noqa: BLE001 - upstream swallows and logs
                logger.error(f"prefill layerwise send cache thread has exception: {e!r}")
                time.sleep(0.01)

    def _block_ranges(self, batch_engine_signals: list) -> tuple[list, list]:
        block_start_end_list, current_prefilled_token_num_list = [], []
        for engine_index, current_step_prefilled_token_num in batch_engine_signals:
            assert engine_index in self.idx_cache_task_dict, (
                f"engine_index {engine_index} not in self.idx_cache_task_dict {self.idx_cache_task_dict}")
            task = self.idx_cache_task_dict[engine_index]
            block_id_start = task["sended_block_num"]
            if current_step_prefilled_token_num == task["need_prefill_tokens"]:
                block_id_end = len(task["src_block_ids"])
            else:
                block_id_end = current_step_prefilled_token_num // self.block_size
            block_start_end_list.append((block_id_start, block_id_end))
            current_prefilled_token_num_list.append(current_step_prefilled_token_num)
        return block_start_end_list, current_prefilled_token_num_list

    def _send_batch(self, batch_engine_signals: list, ranges: list, token_nums: list) -> None:
        first = batch_engine_signals[0][0]
        while not self._stop.is_set():  # from layer 0 to the last layer, as the model runner finishes them
            sended_layer_idx = self.idx_cache_task_dict[first]["sended_layer_id"]
            start_layer_idx = sended_layer_idx + 1
            with self.engine_cache_task_thread_lock:
                prefilled_layer_idx = self.engine_cache_tasks[first]["prefilled_layer_idx"]
                if sended_layer_idx > prefilled_layer_idx:  # computation must be in the next chunk
                    assert token_nums[0] < self.engine_cache_tasks[first]["prefilled_token_num"]
                    end_layer_idx = self.num_layers - 1
                else:
                    end_layer_idx = prefilled_layer_idx
            if sended_layer_idx == prefilled_layer_idx:  # the next layer is not computed yet
                time.sleep(0.01)
            for layer_idx in range(start_layer_idx, end_layer_idx + 1):
                for i, block_range in enumerate(ranges):
                    self._send_layer(layer_idx, batch_engine_signals[i][0], block_range, token_nums[i])
            if end_layer_idx == self.num_layers - 1:
                self._report_finished(batch_engine_signals)
                break

    def _send_layer(self, layer_idx: int, engine_index: int, block_range: tuple, prefilled_tokens: int) -> None:
        task = self.idx_cache_task_dict[engine_index]
        block_id_start, block_id_end = block_range
        if block_id_start < block_id_end:
            target_id = int(task["device_ids"][self.rank])
            return_code = self.messager[task["transfer_protocol"]].write_cache(
                "0.0.0.0", target_id, ids(task["src_block_ids"][block_id_start:block_id_end]),
                ids(task["dest_block_ids"][block_id_start:block_id_end]), layer_idx)
            if return_code != 0:
                task["status"] = "write cache error"
                logger.error(f"write cache failed, layer_idx: {layer_idx}, req_id: {task['request_id']}")
        task["sended_layer_id"] += 1
        assert task["sended_layer_id"] == layer_idx
        if task["sended_layer_id"] == self.num_layers - 1:
            if block_id_start >= block_id_end:
                task["sended_layer_id"] = -1
                return
            task["sended_block_num"] += block_id_end - block_id_start
            if prefilled_tokens == task["need_prefill_tokens"]:
                if "error" not in task["status"]:
                    task["status"] = "finished"
            else:
                task["sended_layer_id"] = -1

    def _report_finished(self, batch_engine_signals: list) -> None:
        with self.engine_cache_task_thread_lock:
            for engine_idx, _ in batch_engine_signals:
                task: Any = self.idx_cache_task_dict[engine_idx]
                if task["status"] == "finished" or "error" in task["status"]:
                    if task["transfer_protocol"] == "ipc":
                        self.messager["ipc"].write_block_by_sync(int(task["device_ids"][self.rank]))
                    self.engine_worker_queue.finish_send_cache_barrier.wait()
                    self.engine_worker_queue.put_finished_req([[task["request_id"], task["status"]]])
                    self.engine_cache_tasks[task["current_id"]] = {}
                    del self.cache_info[task["request_id"]]
                    del self.idx_cache_task_dict[task["current_id"]]
