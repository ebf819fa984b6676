"""The forward-pass thread: the scheduler and `execute_model`, one step at a time.

Each step admits new requests into free batch slots (allocating blocks, which hold "uninitialised" memory,
modelled as NaN), looks up their prefix in the storage cache and issues a prefetch for a hit, then computes the
next chunk of every running prefill. Computing a block reads every earlier block of the sequence (attention),
so NaN anywhere in the context spreads into it. The step holds the observer's cache lock, like the GPU worker
around `execute_model` (a run without a lock takes kvobs's no-op lock). A complete prefill goes to the model
runner and, after its registration delay, to the cache messager; when the messager hands the request back
(sent, or aborted as hung) the scheduler frees its slot and retires it through the write-back.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import kvobs
from kvobs.sim.allocator import BlockAllocator, OutOfBlocks
from kvobs.sim.cache import PagedKVCache
from kvobs.sim.config import SimConfig
from kvobs.sim.messager import CacheMessager
from kvobs.sim.messages import PrefetchTask, Registration, SendEnded
from kvobs.sim.model_runner import LayerProgress, ModelRunner
from kvobs.sim.prefetcher import Prefetcher
from kvobs.sim.stats import RunStats
from kvobs.sim.storage import StorageCache
from kvobs.sim.worker import drain
from kvobs.sim.workload import Request, Workload
from kvobs.sim.write_back import WriteBack


@dataclass(eq=False, kw_only=True)
class ForwardPass:
    """The scheduler and the model's forward steps; the only thread that touches `running` and the slots."""

    stop: threading.Event
    observer: kvobs.KVObserver
    config: SimConfig
    cache: PagedKVCache
    allocator: BlockAllocator
    storage: StorageCache
    workload: Workload
    stats: RunStats
    progress: LayerProgress
    ended: queue.Queue[SendEnded]  # requests the messager hands back, sent or aborted
    prefetcher: Prefetcher
    write_back: WriteBack
    model_runner: ModelRunner
    messager: CacheMessager
    running: list[Request] = field(default_factory=list, init=False)
    _next_request: Request | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        # like the GPU worker's `execute_model`; its wait shows as kvobs_lock_wait_seconds{path="forward"}
        self.execute_model = self.observer.locked("forward")(self._execute_model)
        self.free_slots = list(range(self.config.num_slots - 1, -1, -1))

    def run(self) -> None:
        while not self.stop.is_set():
            for ended in drain(self.ended):
                self._retire(ended)
            issued = self._step()
            if issued is None:
                continue
            for task in issued:
                self.prefetcher.put(task)
            self._advance()
            time.sleep(self.config.step_gap_s)

    def _step(self) -> list[PrefetchTask] | None:
        """One forward step under the cache lock: the prefetches it issued, or None if the lock timed out."""
        try:
            issued = self.execute_model(time.perf_counter())
        except kvobs.LockTimeout:
            self.stats.add(lock_timeouts=1)
            return None
        self.stats.add(forward_steps=1)
        return issued

    def _execute_model(self, called_at: float) -> list[PrefetchTask]:
        """The step's work, lock held: admissions, one chunk per prefill, the rest of the step's GPU time."""
        self.stats.forward_lock_waits.append(time.perf_counter() - called_at)
        issued = self._admit()
        self._compute()
        time.sleep(self.config.step_s)
        return issued

    def _admit(self) -> list[PrefetchTask]:
        """Fill free slots: allocate blocks ("uninitialised": NaN), find a prefix hit, prepare its prefetch."""
        issued = []
        while self.free_slots:
            req = self._peek_request()
            try:
                ids = self.allocator.allocate(req.num_blocks)
            except OutOfBlocks:
                break
            self._next_request = None
            req.slot = self.free_slots.pop()
            req.gpu_block_ids = ids
            self.cache.mark_uninitialised(ids)
            self.stats.add(requests_admitted=1)
            sources = self.storage.longest_prefix(req.keys[: req.prefix_blocks])
            if sources:
                hit = len(sources)
                req.prefetch = PrefetchTask(req.task_id, req.keys[:hit], ids[:hit], sources)
                req.computed = hit
                issued.append(req.prefetch)
            self.running.append(req)
        return issued

    def _peek_request(self) -> Request:
        if self._next_request is None:
            self._next_request = self.workload.next_request()
        return self._next_request

    def _compute(self) -> None:
        """One chunk of every running prefill whose prefetch (if any) has been issued."""
        for req in self.running:
            task = req.prefetch
            if task is not None:
                if task.failed:  # the NaN check refused the prefix: recompute it as a miss
                    req.prefetch = None
                    req.computed = 0
                    req.recomputes += 1
                elif not task.started.is_set():
                    continue
            end = min(req.computed + self.config.chunk_blocks, req.num_blocks)
            for j in range(req.computed, end):
                self.cache.compute_block(req.gpu_block_ids[j], req.keys[j], req.gpu_block_ids[:j])
            req.computed = end

    def _advance(self) -> None:
        """Completed prefills go to the model runner and, after their registration delay, the messager."""
        still = []
        for req in self.running:
            if not _prefill_complete(req):
                still.append(req)
                continue
            self.messager.put(Registration(req, due=time.monotonic() + req.register_delay_s))
            self.model_runner.put(req)
        self.running = still

    def _retire(self, ended: SendEnded) -> None:
        """A request whose send is over: free its slot, write back its new blocks, free them."""
        req = ended.request
        if ended.sent:
            self.stats.add(requests_completed=1)
        else:
            self.stats.add(requests_aborted=1)
        self.progress.clear(req.slot)
        self.free_slots.append(req.slot)
        self.write_back.retire(req)


def _prefill_complete(req: Request) -> bool:
    """Every block computed, and a prefetch (if any) done and not refused (a refused one is recomputed)."""
    task = req.prefetch
    if req.computed < req.num_blocks:
        return False
    return task is None or (task.done.is_set() and not task.failed)
