"""The prefetch thread: copies a prefix hit's stored blocks into the request's newly allocated blocks.

The copy goes block by block with a short sleep per block: a wide race window, on purpose. The forward pass
waits only until the copy has *started* (the engine believes an issued, synchronous copy is as good as done):
unguarded it then reads blocks the copy has not reached yet; guarded the copy holds the cache lock (exclusive
claims of its blocks under a block lock), so the forward step waits for it, or, under a block lock, leaves
the request for a later step (prefix_probe.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import kvobs
from kvobs.demo.cache import nan_blocks
from kvobs.demo.guarded import TransferWorker
from kvobs.demo.messages import PrefetchTask
from kvobs.demo.storage import StorageCache

PREFETCH_SPECS = dict(keys="task.keys", block_ids="task.gpu_block_ids", sync="is_sync", cache="self.gpu_cache")


@dataclass(eq=False, kw_only=True)
class Prefetcher(TransferWorker[PrefetchTask]):
    """storage -> GPU blocks, through `issue_prefetch_storage_task` guarded by `obs.prefetch(...)`."""

    storage: StorageCache
    block_s: float  # storage read per block

    def __post_init__(self) -> None:
        self.issue_prefetch_storage_task = self.guarded(
            self.observer.prefetch(**PREFETCH_SPECS), type(self)._copy_in)

    def _copy_in(self, task: PrefetchTask, is_sync: bool = True) -> int:
        """One block at a time from a slow host buffer: the race window."""
        task.started.set()
        for block_id, src in zip(task.gpu_block_ids, task.sources):
            time.sleep(self.block_s)
            self.gpu_cache[block_id].copy_(src)
        return len(task.gpu_block_ids)

    def handle(self, task: PrefetchTask) -> None:
        try:
            self.issue_prefetch_storage_task(task, is_sync=True)
        except kvobs.CorruptKVError:
            task.failed = True
            self.stats.add(prefetch_corrupt=1)
            self.storage.evict(task.keys)  # quarantine: the next request recomputes and stores clean data
        except Exception:  # noqa: BLE001 - lock timeout, rejection: the request recomputes
            task.failed = True
            self.stats.add(transfer_errors=1)
        else:
            # Ground truth: how many of the blocks this hit loaded held NaN/Inf in storage.
            served = sum(nan_blocks(src.unsqueeze(0)) for src in task.sources)
            self.stats.add(prefetch_done=1, prefix_hits=1, prefix_hit_blocks=len(task.gpu_block_ids),
                           nan_blocks_served_to_prefix_hits=served)
        finally:
            task.started.set()
            task.done.set()
