"""The simulated engine's write-back thread: with the engine-side fix a finished request's blocks go back to the
allocator only once their write-back completed; without it, at once (the unguarded engine's stale-block race).

Driven directly, item by item, with a real observer, allocator, storage cache and paged cache: deterministic.
"""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry

import kvobs
from kvobs.demo.allocator import BlockAllocator
from kvobs.demo.cache import PagedKVCache
from kvobs.demo.stats import RunStats
from kvobs.demo.storage import StorageCache
from kvobs.demo.workload import Request
from kvobs.demo.write_back import WriteBack


def write_back(fix: bool) -> tuple[WriteBack, BlockAllocator, PagedKVCache]:
    cache = PagedKVCache(num_blocks=8, block_size=2, heads=1, head_dim=2)
    allocator = BlockAllocator(8)
    observer = kvobs.KVObserver("test-write-back", lock=None, registry=CollectorRegistry(), integrity="count")
    worker = WriteBack(stop=threading.Event(), observer=observer, gpu_cache=cache.data, stats=RunStats("test"),
                       storage=StorageCache(16), allocator=allocator, block_s=0.0, max_backlog=4,
                       free_after_write_back=fix)
    return worker, allocator, cache


def finished_request(allocator: BlockAllocator, cache: PagedKVCache) -> Request:
    req = Request(req_id=1, family=0, keys=["a", "b", "c"], prefix_blocks=1, register_delay_s=0.0, block_size=2)
    req.gpu_block_ids = allocator.allocate(3)
    for j, (block_id, key) in enumerate(zip(req.gpu_block_ids, req.keys)):
        cache.compute_block(block_id, key, req.gpu_block_ids[:j])
    return req


@pytest.mark.parametrize("fix", [True, False])
def test_blocks_return_to_the_allocator_after_the_write_back_only_with_the_fix(fix):
    worker, allocator, cache = write_back(fix)
    req = finished_request(allocator, cache)
    worker.retire(req)
    assert worker.backlog == 1
    assert allocator.free_count == (5 if fix else 8)  # with the fix the 3 blocks stay owned by the write-back
    worker.handle(worker.inbox.get_nowait())
    assert allocator.free_count == 8
    counters = worker.stats.counters()
    assert counters["write_back_done"] == 1
    assert counters["stale_blocks_written_to_storage"] == counters["nan_blocks_written_to_storage"] == 0
    assert all(key in worker.storage for key in req.keys)


def test_a_block_reused_before_its_write_back_is_stored_stale_without_the_fix():
    worker, allocator, cache = write_back(fix=False)
    req = finished_request(allocator, cache)
    worker.retire(req)
    reused = allocator.allocate(1)[0]  # most recently freed first: one of the request's blocks
    assert reused in req.gpu_block_ids
    cache.compute_block(reused, "another request's key", [])
    worker.handle(worker.inbox.get_nowait())
    assert worker.stats.counters()["stale_blocks_written_to_storage"] == 1


def test_nothing_missing_from_storage_frees_at_once_and_a_full_backlog_skips_the_write_back():
    worker, allocator, cache = write_back(fix=True)
    for key in ("a", "b", "c"):
        worker.storage.put(key, cache.data[0].clone())
    worker.retire(finished_request(allocator, cache))
    assert worker.backlog == 0 and allocator.free_count == 8
    worker.storage = StorageCache(16)
    for _ in range(worker.max_backlog):
        worker.put(object())  # a busy write-back thread
    worker.retire(finished_request(allocator, cache))
    assert worker.backlog == worker.max_backlog and allocator.free_count == 8
    assert worker.stats.counters()["write_back_skipped_busy"] == 1
