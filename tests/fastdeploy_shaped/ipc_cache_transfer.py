"""`IPCCommManager` (upstream: cache_manager/transfer_factory/ipc_cache_transfer.py): `write_cache` launches
one layer's copy to the decode GPU on that connection's write stream and returns 0 at once;
`write_block_by_sync(remote_gpu_id)` waits for the stream. The decode GPU's cache, which upstream is
mapped through CUDA IPC handles, is looked up in `DECODE_CACHES` here, and the stream is a one-thread pool."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from fastdeploy_shaped.tensors import view

DECODE_CACHES: dict[tuple[int, int], tuple[list, list]] = {}  # (rank, remote gpu) -> decode (keys, values)


class IPCConnector:
    def __init__(self, rank_id_: int, remote_gpu_id_: int, layer_num: int, local_gpu_id_: int) -> None:
        self.remote_gpu_id = int(remote_gpu_id_)
        self.rank_id = rank_id_
        keys, values = DECODE_CACHES[(rank_id_, self.remote_gpu_id)]
        self.remote_key_tensor_ptr_list = keys[:layer_num]
        self.remote_value_tensor_ptr_list = values[:layer_num]
        self.write_stream = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.pending: list[concurrent.futures.Future] = []


class IPCCommManager:
    def __init__(self, rank_id_, gpu_idx_, local_key_cache_tensor_list, local_value_cache_tensor_list):
        self.rank_id = rank_id_
        self.gpu_idx = gpu_idx_
        self.local_key_cache_tensor_list = local_key_cache_tensor_list
        self.local_value_cache_tensor_list = local_value_cache_tensor_list
        self.layer_num = len(self.local_key_cache_tensor_list)
        self.comm_map: dict[int, IPCConnector] = {}

    def connect(self, remote_gpu_id_=0):
        if not self.is_connected(remote_gpu_id_):
            self.comm_map[remote_gpu_id_] = IPCConnector(self.rank_id, remote_gpu_id_, self.layer_num, self.gpu_idx)
        return True

    def is_connected(self, remote_gpu_id_=0):
        return remote_gpu_id_ in self.comm_map

    def write_cache(self, ip, remote_gpu_id, local_block_ids, remote_block_ids, layer_idx):
        if not self.is_connected(remote_gpu_id):
            self.connect(remote_gpu_id)
        comm = self.comm_map[remote_gpu_id]
        local = [int(b) for b in view(local_block_ids)]
        remote = [int(b) for b in view(remote_block_ids)]
        comm.pending.append(comm.write_stream.submit(  # ipc_sent_key_value_cache_by_remote_ptr on the stream
            _copy_layer, self.local_key_cache_tensor_list[layer_idx], self.local_value_cache_tensor_list[layer_idx],
            local, remote, comm.remote_key_tensor_ptr_list[layer_idx], comm.remote_value_tensor_ptr_list[layer_idx]))
        return 0

    def write_block_by_sync(self, remote_gpu_id):
        comm = self.comm_map[remote_gpu_id]
        pending, comm.pending = comm.pending, []
        for future in pending:
            future.result()


def _copy_layer(key: Any, value: Any, local: list[int], remote: list[int], remote_key: Any, remote_value: Any) -> None:
    for src, dst in ((key, remote_key), (value, remote_value)):
        src_view, dst_view = view(src), view(dst)
        for local_id, remote_id in zip(local, remote):
            if remote_id >= 0:  # -1: a block the decode node already holds
                dst_view[remote_id] = src_view[local_id]
