"""kvobs on SGLang's HiCache: write-throughs and load-backs become transfers, checked when the data is there.

In a server, two lines in the process that runs SGLang's scheduler do it (before the scheduler builds its
cache):

    obs = kvobs.KVObserver("sglang", lock=None, page_size=64)   # SGLang's --page-size
    kvobs_sglang.instrument_hicache(obs)                        # HiCacheController, HybridCacheController

This script shows it on SGLang's real HiCacheController, on CPU; it needs SGLang 0.5.23 installed beside kvobs
(without it, it says so and exits). On CPU SGLang has no host<->device copy kernel (it comes from the CUDA-only
sgl_kernel), so this script supplies one written with torch indexing.
"""

from __future__ import annotations

import math
import sys
import threading

from prometheus_client import CollectorRegistry, generate_latest

import kvobs
from kvobs.integrations import sglang as kvobs_sglang

PAGE = 4


def sglang_or_exit() -> None:
    """Exit 0 saying what is missing when SGLang (which brings torch) is not installed."""
    try:
        import sglang.srt.managers.cache_controller  # noqa: F401
    except ImportError as exc:
        print(f"skipped: needs SGLang 0.5.23 installed beside kvobs (pip install sglang==0.5.23): {exc}")
        sys.exit(0)


def cpu_copy(src_layers, dst_layers, src_indices, dst_indices, page_size):
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices] = src[src_indices]


def controller_on_cpu():
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache import memory_pool
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.pool_host import mha

    if not hasattr(mha, "transfer_kv_direct"):
        mha.transfer_kv_direct = cpu_copy
    pool = memory_pool.MHATokenToKVPool(64, PAGE, torch.float32, 2, 4, 2, "cpu", False)
    allocator = PagedTokenToKVPoolAllocator(64, PAGE, torch.float32, "cpu", pool, need_sort=False)
    host = mha.MHATokenToKVPoolHost(pool.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, "layer_first",
                                    pin_memory=False, device_capacity_tokens=pool.size, start_layer=0, end_layer=2)
    return HiCacheController(allocator, host, PAGE, None, threading.Event(), io_backend="direct"), pool, allocator


def take_acks(acks: list) -> None:
    """What SGLang's radix cache does in writing_check / loading_check once a copy's event is done."""
    while acks:
        acks.pop(0).finish_event.synchronize()


def main() -> None:
    sglang_or_exit()
    registry = CollectorRegistry()
    obs = kvobs.KVObserver("sglang-example", lock=None, page_size=PAGE, registry=registry)
    controller, pool, allocator = controller_on_cpu()
    undo = kvobs_sglang.instrument_hicache(obs, controller)  # or the classes: instrument_hicache(obs)
    slots = allocator.alloc(2 * PAGE)
    for layer in [*pool.k_buffer, *pool.v_buffer]:
        layer[slots] = 0.5
    host = controller.write(slots, node_id=1)  # copied to host now; its transfer ends at the ack
    take_acks(controller.ack_write_queue)
    destination = controller.load(host, node_id=2)  # queued; the copy runs in start_loading()
    print(f"load-back queued into slots {destination.tolist()}, open prefetches: {obs.open.count('prefetch')}")
    controller.start_loading()
    take_acks(controller.ack_load_queue)
    for layer in [*pool.k_buffer, *pool.v_buffer]:
        layer[slots[:1]] = math.nan
    print(f"write-back of a NaN page returned {controller.write(slots, node_id=3)}")  # not copied
    undo()
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(("kvobs_transfers_total", "kvobs_nan_checks_total")) and not line.endswith(" 0.0"):
            print(line)


if __name__ == "__main__":
    main()
