"""The write-back thread: stores a finished request's new blocks in the storage cache, block by block.

Each write-back is a transfer of kvobs's lifecycle: begun (`obs.begin`) when the thread takes the task up and
its copy starts, which takes the lock (shared blocks under a block lock) and checks the sources; completed
(`t.complete`) when the last block is stored; only then, with the engine-side fix, do the request's blocks
go back to the allocator. Beginning at issue instead would hold the lock while the task waits in the queue,
which under a global lock stalls every forward step for the whole backlog.

Each block is read when its turn comes, with a short sleep per block. If the blocks were freed when the
request finished (`free_after_write_back=False`, the unguarded run), they may already belong to a new request:
its allocation filled them with NaN (NaN is stored under the old request's keys, and later prefix hits
prefetch it) or its forward pass wrote its own KV (finite, but another request's: a stale block, which no NaN
check can see).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import kvobs
from kvobs.demo.allocator import BlockAllocator
from kvobs.demo.cache import key_values
from kvobs.demo.guarded import TransferWorker
from kvobs.demo.messages import WriteBackTask
from kvobs.demo.storage import StorageCache
from kvobs.demo.workload import Request


@dataclass(eq=False, kw_only=True)
class WriteBack(TransferWorker[WriteBackTask]):
    """GPU blocks -> storage, one `write_back` transfer per finished request."""

    storage: StorageCache
    allocator: BlockAllocator
    block_s: float  # storage write per block
    max_backlog: int  # a busy engine skips write-backs beyond this backlog
    free_after_write_back: bool

    def retire(self, req: Request) -> None:
        """A request finished: issue the write-back of the blocks storage lacks, and free the request's blocks
        (at once, or after the write-back)."""
        missing = self.storage.missing(req.keys)
        task = None
        if missing and self.backlog >= self.max_backlog:
            self.stats.add(write_back_skipped_busy=1)
        elif missing:
            task = WriteBackTask(req.task_id, [req.keys[i] for i in missing],
                                 [req.gpu_block_ids[i] for i in missing], req.gpu_block_ids)
            self.put(task)
        if task is None or not self.free_after_write_back:
            self.allocator.free(req.gpu_block_ids)

    def handle(self, task: WriteBackTask) -> None:
        try:
            self._write_back(task)
        finally:
            if self.free_after_write_back:
                self.allocator.free(task.owned_block_ids)

    def _write_back(self, task: WriteBackTask) -> None:
        """Begin, copy, complete. A refusal (NaN in the sources, lock timeout, bad input) stores nothing."""
        try:
            transfer = self.observer.begin("write_back", keys=task.keys, block_ids=task.gpu_block_ids,
                                           cache=self.gpu_cache, request_id=task.task_id)
        except kvobs.CorruptKVError:
            self.stats.add(write_back_rejected=1)
            return
        except Exception:  # noqa: BLE001 - lock timeout, rejection: nothing stored, the engine goes on
            self.stats.add(transfer_errors=1)
            return
        try:
            stored = self._copy_out(task)
        except BaseException as exc:
            transfer.fail(exc)
            raise
        transfer.complete(stored)
        self.stats.add(write_back_done=1)

    def _copy_out(self, task: WriteBackTask) -> int:
        """One block at a time; counts what reached storage that does not belong under its key."""
        for key, block_id in zip(task.keys, task.gpu_block_ids):
            time.sleep(self.block_s)
            block = self.gpu_cache[block_id].clone()
            self.storage.put(key, block)
            if not bool(block.isfinite().all()):
                self.stats.add(nan_blocks_written_to_storage=1)
            elif not torch.equal(block, key_values(key, block.shape, block.dtype)):
                # Finite, but another request's KV: the block was reused before its write-back ran.
                self.stats.add(stale_blocks_written_to_storage=1)
        return len(task.gpu_block_ids)
